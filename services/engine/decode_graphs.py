"""Compiled decode steps: the small-batch fast path.

At batch 1 a step of a small model is ~460 tensor operations of a few microseconds each; eager
PyTorch spends most of the step between them, not in them. A decode-only step
(``MoECausalLM.decode_graph``: one token per sequence, shapes from the inputs alone) is exported
once and compiled by inductor into fused C++, for two shapes: batch 1, and every batch from 2 to
``max_batch`` (the batch and the block-table width are symbolic, so neither a growing context nor
a changing batch recompiles after warm-up). Calls go to the compiled code directly, without
dynamo's guards. Inductor caches compiled code on disk (``TORCHINDUCTOR_CACHE_DIR``).

The batch-1 graph holds the weights frozen: a model whose weights change after start-up (a DEP
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

from ferry.services.engine.model import MoECausalLM

Log = Callable[[str], None]

# The batch-1 graph (one user: the latency that counts) freezes the weights into the graph as
# constants (prepacked: a second copy of them), so that max-autotune may pick inductor's C++
# micro-GEMM over the BLAS call: at batch 1 it took 2.6 us where MKL took 9.6 for a 256x128
# product, and the tiny model's step went from ~1.0 to ~0.6 ms. Inductor's on-disk cache skips
# frozen graphs, so this one compiles at every start (~30 s for tiny); the batched graph stays
# unfrozen and cached (~5 s once warm). Its ~50 kernels are called from generated C++, not from
# a generated Python function, which cost ~0.4 ms a step (tiny: 1.59 -> 1.18 ms). The batched
# graph keeps the Python wrapper: served, the C++ one gave no more tokens a second.
SINGLE_USER_OPTIONS = {
    "cpp_wrapper": True,
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


class _DecodeModule(nn.Module):
    """What export traces: the model's ``decode_graph`` with the KV cache as an argument."""

    def __init__(self, model: MoECausalLM, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        kv_rows: torch.Tensor,
        expert_counts: torch.Tensor,
    ) -> torch.Tensor:
        return self.model.decode_graph(
            input_ids, positions, block_tables, kv_rows, expert_counts, self.block_size
        )


class DecodeGraphs:
    """Compiled decode steps for batches of 1..``max_batch`` sequences of one model."""

    def __init__(
        self,
        model: MoECausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        log: Log | None = None,
    ) -> None:
        self.model = model
        self.kv_rows = kv_cache.view(-1, kv_cache.shape[-1])
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_width = max(2, -(-max_model_len // block_size))
        self._graphs: dict[bool, Any] = {}  # batched (B >= 2) or not -> compiled step
        self.steps = 0  # steps run, for tests and benchmarks
        shapes = [False, True] if max_batch >= 2 else [False]
        for n, batched in enumerate(shapes, 1):
            if log:
                what = f"2..{max_batch}" if batched else "1"
                log(f"compiling the decode step for batch {what} ({n}/{len(shapes)})")
            self._graphs[batched] = self._compile(batched)

    def covers(self, batch: int) -> bool:
        return 1 <= batch <= self.max_batch

    def _example(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a step of ``batch`` sequences, each its second token, ``width`` blocks."""
        dev = self.model.device
        tables = torch.zeros(batch, width, dtype=torch.long, device=dev)
        # distinct tensors: compile would merge aliased inputs
        ids, positions = (torch.ones(batch, dtype=torch.long, device=dev) for _ in range(2))
        return (ids, positions, tables, self.kv_rows, self._counts_example())

    def _counts_example(self) -> torch.Tensor:
        c = self.model.config
        n = c.num_moe_layers * c.n_routed_experts
        return torch.zeros(n, dtype=torch.long, device=self.model.device)

    def _compile(self, batched: bool) -> Any:
        # inductor gives equal sizes one symbol: example sizes that equal a dimension of the
        # cache (or each other) would be specialised to it
        taken = {*self.kv_rows.shape, self._counts_example().numel()}
        width = unlike(taken, 2, self.max_width)
        batch = unlike(taken | {width}, 2, self.max_batch) if batched else 1
        example = self._example(batch, width)
        dims: tuple[dict[int, Any] | None, ...]
        if not batched:
            w = torch.export.Dim("width", min=2, max=max(width, self.max_width))
            dims = (None, None, {1: w}, None, None)
        else:
            b = torch.export.Dim("batch", min=2, max=max(batch, self.max_batch))
            w = torch.export.Dim("width", min=2, max=max(width, self.max_width))
            dims = ({0: b}, {0: b}, {0: b, 1: w}, None, None)
        module = _DecodeModule(self.model, self.block_size)
        return export_and_compile(module, example, dims, {} if batched else SINGLE_USER_OPTIONS)

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        expert_counts: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step: sequence i adds ``input_ids[i]`` at ``positions[i]`` with blocks
        ``block_tables[i]``. Returns float32 logits [B, vocab]; adds the step's MoE choices into
        ``expert_counts`` ([moe_layers * experts] int64, see ``ExpertLoad.counts_buffer``)."""
        bs = self.block_size
        width = max(2, max(p // bs + 1 for p in positions))
        tables = [list(t[:width]) + [0] * (width - len(t[:width])) for t in block_tables]
        dev = self.model.device
        args = (
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(tables, device=dev),
            self.kv_rows,
            expert_counts,
        )
        self.steps += 1
        logits: torch.Tensor = self._graphs[len(input_ids) > 1](*args)
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
    dims: tuple[dict[int, Any] | None, ...],
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
