"""Compiled decode steps: the small-batch fast path.

At batch 1 a step of a small model is ~460 tensor operations (V3; V4 ~8,500) of a few
microseconds each; eager PyTorch spends most of the step between them, not in them. A
decode-only step (``MoECausalLM.decode_graph``: one token per sequence, shapes from the inputs
alone, the cache's tensors as inputs that it writes in place) is exported once and compiled by
inductor into fused C++ for the batch sizes of ``graph_plan``: V3 batch 1 and every batch from 2
to ``max_batch``, V4 every batch from 1 (the batch and the block-table width are symbolic, so
neither a growing context nor a changing batch recompiles after warm-up). Calls go to the
compiled code directly, without dynamo's guards. Inductor caches compiled code on disk
(``TORCHINDUCTOR_CACHE_DIR``).

V3's batch-1 graph holds the weights frozen: a model whose weights change after start-up (a DEP
rank's EPLB moves experts) must not use these graphs. Steps with prefill chunks, larger batches,
DEP ranks (their MoE exchanges tokens) and models without ``decode_graph`` run eagerly.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ferry.services.engine.model import DeepseekV4ForCausalLM, MoECausalLM
from ferry.services.engine.model.forward_batch import GraphStep

Log = Callable[[str], None]

# The batch-1 graph (one user: the latency that counts) freezes the weights into the graph as
# constants (prepacked: a second copy of them), so that max-autotune may pick inductor's C++
# micro-GEMM, faster than the BLAS call for a decode step's small products. Inductor's on-disk
# cache skips frozen graphs, so this one compiles at every start; the batched graph stays
# unfrozen and cached. Its kernels are called from generated C++, not from a generated Python
# function, whose per-call cost was a large share of a tiny step. The batched graph keeps the
# Python wrapper: served, the C++ one gave no more tokens a second.
SINGLE_USER_OPTIONS = {
    "cpp_wrapper": True,
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}
# DeepSeek-V4's step has several times V3's matrix shapes, and autotuning each would put the
# batch-1 graph's compile past the start-up bound. So V4 compiles one unfrozen graph, cached on
# disk, for every batch from 1, with the C++ wrapper (faster than the Python one at 1 and 8
# users; a graph for batch 1 alone gained nothing over it). Its kernels build apart from the wrapper, which compiles sooner at the same
# speed.
V4_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def graph_plan(model: MoECausalLM, max_batch: int) -> list[tuple[int, int, dict[str, Any]]]:
    """(smallest batch, largest batch, inductor's options) of each graph to compile."""
    if isinstance(model, DeepseekV4ForCausalLM):
        return [(1, max_batch, V4_OPTIONS)]
    return [(1, 1, SINGLE_USER_OPTIONS)] + ([(2, max_batch, {})] if max_batch >= 2 else [])


class _DecodeModule(nn.Module):
    """What export traces: the model's ``decode_graph`` with the cache's tensors as inputs."""

    def __init__(self, model: MoECausalLM, kv_cache: Any, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.kv_cache = kv_cache  # (its layout: the graph reads and writes its inputs)
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        expert_counts: torch.Tensor,
        *cache: torch.Tensor,
    ) -> torch.Tensor:
        step = GraphStep(input_ids, positions, slots, block_tables, expert_counts, self.block_size)
        return self.model.decode_graph(step, self.kv_cache, cache)


class DecodeGraphs:
    """Compiled decode steps for batches of 1..``max_batch`` sequences of one model."""

    def __init__(
        self,
        model: MoECausalLM,
        kv_cache: Any,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        log: Log | None = None,
        plan: list[tuple[int, int, dict[str, Any]]] | None = None,
    ) -> None:
        """``plan``: the graphs to compile, default ``graph_plan(model, max_batch)``."""
        self.model = model
        self.kv_cache = kv_cache
        self.cache_inputs = model.graph_inputs(kv_cache)
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_width = max(2, -(-max_model_len // block_size))
        self._graphs: list[tuple[int, Any]] = []  # (largest batch, compiled step), ascending
        self.steps = 0  # steps run, for tests and benchmarks
        plan = plan or graph_plan(model, max_batch)
        for n, (low, high, options) in enumerate(plan, 1):
            if log:
                what = f"{low}..{high}" if high > low else f"{low}"
                log(f"compiling the decode step for batch {what} ({n}/{len(plan)})")
            self._graphs.append((high, self._compile(low, high, options)))

    def covers(self, batch: int) -> bool:
        return 1 <= batch <= self.max_batch

    def _example(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a step of ``batch`` sequences, each its second token, ``width`` blocks."""
        dev = self.model.device
        tables = torch.zeros(batch, width, dtype=torch.long, device=dev)
        # distinct tensors: compile would merge aliased inputs
        ids, positions = (torch.ones(batch, dtype=torch.long, device=dev) for _ in range(2))
        slots = torch.zeros(batch, dtype=torch.long, device=dev)
        return (ids, positions, slots, tables, self._counts_example(), *self.cache_inputs)

    def _counts_example(self) -> torch.Tensor:
        c = self.model.config
        n = c.num_moe_layers * c.n_routed_experts
        return torch.zeros(n, dtype=torch.long, device=self.model.device)

    def _compile(self, low: int, high: int, options: dict[str, Any]) -> Any:
        """A step for batches of ``low`` .. ``high`` sequences (low == high: that size only)."""
        # inductor gives equal sizes one symbol: example sizes that equal a dimension of the
        # cache (or each other) would be specialised to it
        taken = {self._counts_example().numel(), *(d for t in self.cache_inputs for d in t.shape)}
        batch = unlike(taken, max(low, 2), high) if high > low else low
        width = unlike(taken | {batch}, 2, self.max_width)  # a fixed batch of 2 would pin it
        example = self._example(batch, width)
        w = torch.export.Dim("width", min=2, max=max(width, self.max_width))
        if high == low:
            per_seq: tuple[dict[int, Any] | None, ...] = (None, None, None, {1: w})
        else:
            b = torch.export.Dim("batch", min=low, max=max(batch, high))
            per_seq = ({0: b}, {0: b}, {0: b}, {0: b, 1: w})
        dims = (*per_seq, None, tuple(None for _ in self.cache_inputs))  # (*cache: one entry)
        module = _DecodeModule(self.model, self.kv_cache, self.block_size)
        return export_and_compile(module, example, dims, options)

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        expert_counts: torch.Tensor,
        slots: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One decode step: sequence i adds ``input_ids[i]`` at ``positions[i]`` with blocks
        ``block_tables[i]`` (and state slot ``slots[i]``, for a model with state). Returns
        float32 logits [B, vocab]; adds the step's MoE choices into ``expert_counts``
        ([moe_layers * experts] int64, see ``ExpertLoad.counts_buffer``)."""
        bs = self.block_size
        width = max(2, max(p // bs + 1 for p in positions))
        tables = [list(t[:width]) + [0] * (width - len(t[:width])) for t in block_tables]
        dev = self.model.device
        args = (
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots or [0] * len(input_ids), device=dev),
            torch.tensor(tables, device=dev),
            expert_counts,
            *self.cache_inputs,
        )
        self.steps += 1
        graph = next(g for high, g in self._graphs if len(input_ids) <= high)
        logits: torch.Tensor = graph(*args)
        return logits


def unlike(taken: set[int], low: int, high: int) -> int:
    """The smallest size in low..high (or past it) that is not in ``taken``."""
    size = low
    while size in taken and size < high + 64:
        size += 1
    return size


def export_and_compile(
    module: nn.Module,
    example: tuple[torch.Tensor, ...],
    dims: tuple[Any, ...],
    options: dict[str, Any] | None = None,
) -> Any:
    """``module`` exported over ``example`` (``dims``: export's dynamic shapes) and compiled by
    inductor with ``options``: a callable over tensors like ``example``, with no guards."""
    # export traces with autograd off but outside inference mode: a graph captured under
    # inference_mode cannot be called outside it (tests and the engine run both)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own pytree
        exported = torch.export.export(module, example, dynamic_shapes=dims, strict=False)
        graph = _plain(exported.module())
        # (a frozen graph cannot be saved: inductor says so on every compile)
        quiet = logging.getLogger("torch._inductor.standalone_compile")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with torch._inductor.config.patch(options or {}):
                return torch._inductor.standalone_compile(
                    graph, list(example), dynamic_shapes="from_graph"
                )
        finally:
            quiet.setLevel(level)


def _plain(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same graph over only the tensors it reads: export's module carries hooks and a guard
    checker that inductor's on-disk cache cannot pickle (it would compile from scratch on every
    start); the shapes are ours, the checks are not needed."""
    for node in list(module.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":  # export's input checks
            module.graph.erase_node(node)
    targets = {str(n.target) for n in module.graph.nodes if n.op == "get_attr"}
    root = {t: functools.reduce(getattr, t.split("."), module) for t in targets}
    return torch.fx.GraphModule(root, module.graph)
