"""Pieces of the eager forward compiled into fused kernels (CPU), for models and steps that the
decode graphs (``decode_graphs.py``) do not run: prefill chunks and batches past
``max_graph_batch``, V3's and V4's.

- V4's hyper-connections (two per decoder layer) make their stream weights with a Sinkhorn
  normalisation of ``hc_sinkhorn_iters`` rounds: ~140 tensor operations of a few microseconds on
  [tokens, 4, 4] tensors, the most of any V4 module (1,136 of a v4-tiny decode step's ~2,900).
- The routed experts of a small batch run as a Python loop over the chosen experts, with a host
  sync for each; ``fused_moe_gathered`` reads each token's experts where they lie instead, which
  inductor fuses into the products (as the decode graphs do). Up to ``max_graph_batch`` tokens:
  past 16, reading every token's experts lost to the loop in the decode graphs of ``small``.

Each piece takes its weights as arguments, so one exported graph, the token count symbolic,
serves every layer and every step without recompiling; inductor caches it on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ferry.kernels.fused_moe.reference import fused_moe_gathered
from ferry.services.engine.decode_graphs import export_and_compile, unlike
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.mhc import HyperConnection
from ferry.services.engine.model.moe import MoE

Log = Callable[[str], None]
Compiled = Callable[..., Any]


class _Mix(nn.Module):
    """``HyperConnection.mix`` with the weights as inputs."""

    def __init__(self, hc: HyperConnection) -> None:
        super().__init__()
        self.hc = hc

    def forward(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hc.mix(streams, fn, base, scale)


class _Experts(nn.Module):
    """``fused_moe_gathered`` with the expert weights as inputs."""

    def __init__(self, swiglu_limit: float | None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit

    def forward(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_slots: torch.Tensor,
    ) -> torch.Tensor:
        return fused_moe_gathered(hidden, w13, w2, topk_weights, topk_slots, self.swiglu_limit)


def compile_pieces(model: MoECausalLM, max_batch: int, log: Log | None = None) -> int:
    """Give ``model``'s hyper-connections their compiled mixing (``hc.compiled``) and its
    decoder's MoE layers their compiled experts for up to ``max_batch`` tokens
    (``moe.small_batch``; not on a DEP rank, whose experts are on several ranks; not a drafter's,
    which speculative decoding runs). One graph per distinct configuration; returns how many."""
    graphs: dict[tuple[object, ...], Compiled] = {}
    decoder = set(model.moe_layers())
    for m in model.modules():
        if isinstance(m, HyperConnection) and m.mixes_in_forward:
            key: tuple[object, ...] = (m.hc, m.iters, m.eps, m.norm.eps, m.fn.shape, m.fn.dtype)
            if key not in graphs:
                if log:
                    log(f"compiling the hyper-connection mixing ({len(graphs) + 1})")
                graphs[key] = _compile_mix(m)
            m.compiled = graphs[key]
        elif m in decoder and m.ep_group is None and max_batch >= 1:
            assert isinstance(m, MoE)
            w13, w2 = m.experts.w13, m.experts.w2
            key = (m.swiglu_limit, w13.shape, w2.shape, w13.dtype)
            if key not in graphs:
                if log:
                    log(f"compiling the routed experts ({len(graphs) + 1})")
                graphs[key] = _compile_experts(m, max_batch)
            m.small_batch = (max_batch, graphs[key])
    return len(graphs)


def _compile_mix(hc: HyperConnection) -> Compiled:
    hidden = hc.fn.shape[1] // hc.hc
    # (inductor gives equal sizes one symbol: the example's token count must differ from them)
    tokens = unlike({hc.hc, hidden, *hc.fn.shape, *hc.base.shape, *hc.scale.shape}, 2, 64)
    streams = torch.zeros(tokens, hc.hc, hidden, dtype=hc.fn.dtype, device=hc.fn.device)
    t = torch.export.Dim("tokens", min=1)
    return export_and_compile(
        _Mix(hc), (streams, hc.fn, hc.base, hc.scale), ({0: t}, None, None, None)
    )


def _compile_experts(moe: MoE, max_batch: int) -> Compiled:
    w13, w2 = moe.experts.w13, moe.experts.w2
    top_k = moe.config.num_experts_per_tok
    tokens = unlike({*w13.shape, *w2.shape, top_k}, 2, max_batch)
    dev = w13.device
    hidden = torch.zeros(tokens, w13.shape[-1], dtype=w13.dtype, device=dev)
    weights = torch.rand(tokens, top_k, device=dev)
    slots = torch.zeros(tokens, top_k, dtype=torch.long, device=dev)
    t = torch.export.Dim("tokens", min=1, max=max(tokens, max_batch))
    return export_and_compile(
        _Experts(moe.swiglu_limit),
        (hidden, w13, w2, weights, slots),
        ({0: t}, None, None, {0: t}, {0: t}),
    )
