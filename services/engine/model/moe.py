"""DeepSeekMoE, as both families run it: routed experts stacked per physical slot
(``experts.w13``, ``experts.w2``; the loader maps a checkpoint's
``experts.{e}.{gate,up,down}_proj`` onto them through the ExpertPlacement), a learned or a
hash router (V4's first layers), always-on shared experts, and the dense MLP they and V3's dense
layers are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ferry import kernels as ops
from ferry.kernels.fused_moe.reference import swiglu
from ferry.services.engine.expert_load import ExpertLoad
from ferry.services.engine.expert_parallel import EPGroup, combine, dispatch
from ferry.services.engine.experts import ExpertPlacement

if TYPE_CHECKING:  # V4MoE passes its own config and overrides what reads V3-only fields
    from ferry.services.engine.model.v3.config import ModelConfig


class MLP(nn.Module):
    """SiLU-gated MLP: the dense layers and the shared experts (DeepSeek-V4's clamped at
    ``swiglu_limit``)."""

    def __init__(self, hidden: int, inter: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Router(nn.Module):
    """The MoE gate. Kept in float32, as DeepSeek runs it, whatever the model's dtype."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor
        bias = torch.zeros(num_experts, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", bias)


class HashRouter(nn.Module):
    """A hash-MoE layer's gate (DeepSeek-V4): the experts come from ``tid2eid[token id]``,
    fixed; the learned ``weight`` only scores them. Nothing steers it: no bias."""

    def __init__(self, num_experts: int, hidden: int, vocab_size: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.tid2eid: torch.Tensor
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))


class RoutedExperts(nn.Module):
    """The routed experts held on this rank, one row per physical slot."""

    def __init__(self, num_slots: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * inter, hidden))  # gate rows, up rows
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden, inter))


class MoE(nn.Module):
    """DeepSeekMoE: group-limited top-k routed experts plus always-on shared experts.
    Subclasses change how tokens are routed (``route``) and the SwiGLU clamp."""

    swiglu_limit: float | None = None

    def __init__(self, config: ModelConfig, moe_layer: int, placement: ExpertPlacement) -> None:
        super().__init__()
        self.config = config
        self.moe_layer = moe_layer  # index among MoE layers (the placement's row)
        self.placement = placement
        self.gate: Router | HashRouter = Router(config.n_routed_experts, config.hidden_size)
        inter = config.moe_intermediate_size
        self.experts = RoutedExperts(placement.slots_per_rank, config.hidden_size, inter)
        self.ep_group: EPGroup | None = None  # set by attach_ep_group on a DEP rank
        self.expert_load: ExpertLoad | None = None  # set by attach_expert_load
        # the routed experts of up to ``small_batch[0]`` tokens as one fused kernel, where the
        # engine compiled it (piece_graphs.py): (most tokens, compiled fused_moe_gathered)
        self.small_batch: tuple[int, Callable[..., torch.Tensor]] | None = None
        self.shared_experts = (
            MLP(config.hidden_size, inter * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    @property
    def correction_bias(self) -> torch.Tensor | None:
        """The bias that steers which experts are picked (None where nothing can)."""
        return self.gate.e_score_correction_bias if isinstance(self.gate, Router) else None

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, logical expert ids [T, top_k] int64)."""
        c = self.config
        logits = F.linear(x.float(), self.gate.weight)  # [T, n_routed_experts] float32
        return ops.moe_route(
            logits,
            self.correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden]; input_ids: [T], for layers that route by token id."""
        weights, ids = self.route(x, input_ids)
        if self.expert_load is not None:
            self.expert_load.add(self.moe_layer, ids)
        return self.apply_experts(x, weights, ids)

    def apply_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts ``route`` chose (logical ``ids``), plus the shared ones."""
        slots = self.placement.select_slots(self.moe_layer, ids)
        limit = self.swiglu_limit
        w13, w2 = self.experts.w13, self.experts.w2
        if self.ep_group is None:
            if self.small_batch and x.shape[0] <= self.small_batch[0]:
                out = self.small_batch[1](x, w13, w2, weights, slots)
            else:
                out = ops.fused_moe(x, w13, w2, weights, slots, limit)
        else:  # the slots live on several ranks: send the rows there and back
            d = dispatch(x, slots, weights, self.placement.slots_per_rank, self.ep_group)
            if self.expert_load is not None:
                self.expert_load.add_rows(self.moe_layer, d.hidden.shape[0])
            y = ops.fused_moe(d.hidden, w13, w2, d.weights[:, None], d.local_slots[:, None], limit)
            out = combine(y, d, self.ep_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
