"""A whole decode step of the ``small`` model with CUDA graphs, at batch 1..256 (issue 31).

    python loadtest/bench_cuda_graphs.py           # a CUDA GPU -> loadtest/results/cuda-graphs-small.json
    python loadtest/bench_cuda_graphs.py --device cpu --model tiny --batches 1,2 --context 64 --steps 3

Per batch size B: B sequences of ``--context`` tokens (random latents in the paged cache: the
arithmetic does not depend on them) each add one token, as the engine's decode step does it:
the step's inputs go host -> device, the model's ``decode_graph`` runs (one token per sequence,
no host sync, the Triton kernels on a GPU), greedy argmax on the device, and the B next tokens
come back to the host (the step's one sync). Two ways side by side:

- eager: the same calls, each operator launched from Python;
- CUDA graph: the step captured once per batch size into static buffers and replayed, as
  vLLM's ``cudagraph_capture_sizes`` (no padding here: every measured size is captured).

Reports ms per step, output tok/s and tok/s for each user; batch 1's per-user figure stands
beside the seed's 826 tok/s for one user (DeepSeek-V4.1-Flash on GB300 with MTP speculative
decoding: another model, chip and method; the row says how far launch overhead is cut, not who
is faster). Without a CUDA device it says so and exits 0; ``--device cpu`` checks the script
(eager rows only; with ``FERRY_KERNELS=triton TRITON_INTERPRET=1``, on the GPU's kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from harness import record, write_result

from ferry.services.engine.model import load_model
from ferry.services.engine.model.forward_batch import GraphStep

SEED_ONE_USER_TOK_S = 826.0
DEFAULT_OUT = "loadtest/results/cuda-graphs-small.json"


class Step:
    """One batch size's decode step over static device buffers (what a graph replays)."""

    def __init__(
        self, model: Any, kv_cache: torch.Tensor, block_size: int, batch: int, context: int
    ) -> None:
        dev = kv_cache.device
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.cache_inputs = model.graph_inputs(kv_cache)
        width = context // block_size + 1
        # host side, pinned on a GPU: what the engine builds every step
        pin = dev.type == "cuda"
        gen = torch.Generator().manual_seed(batch)
        self.host_ids = torch.randint(0, model.config.vocab_size, (batch,), generator=gen)
        self.host_positions = torch.full((batch,), context, dtype=torch.long)
        self.host_tables = torch.arange(batch * width, dtype=torch.long).view(batch, width)
        if pin:
            self.host_ids, self.host_positions, self.host_tables = (
                t.pin_memory() for t in (self.host_ids, self.host_positions, self.host_tables)
            )
        self.ids = torch.empty(batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.empty(batch, dtype=torch.long, device=dev)
        self.tables = torch.empty(batch, width, dtype=torch.long, device=dev)
        n = model.config.num_moe_layers * model.config.n_routed_experts
        self.counts = torch.zeros(n, dtype=torch.long, device=dev)
        self.next_ids: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def inputs(self) -> None:
        self.ids.copy_(self.host_ids, non_blocking=True)
        self.positions.copy_(self.host_positions, non_blocking=True)
        self.tables.copy_(self.host_tables, non_blocking=True)

    def forward(self) -> torch.Tensor:
        step = GraphStep(
            self.ids, self.positions, self.slots, self.tables, self.counts, self.block_size
        )
        logits = self.model.decode_graph(step, self.kv_cache, self.cache_inputs)
        return logits.argmax(dim=-1)

    def eager(self) -> list[int]:
        self.inputs()
        out: list[int] = self.forward().tolist()
        return out

    def capture(self) -> None:
        self.inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # Triton's JIT and the allocator's pools warm up off the graph
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.next_ids = self.forward()

    def replay(self) -> list[int]:
        assert self.graph is not None and self.next_ids is not None
        self.inputs()
        self.graph.replay()
        out: list[int] = self.next_ids.tolist()
        return out


def timed(fn: Any, steps: int, warmup: int = 3) -> float:
    """Median ms of one call (each call ends in its host sync)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--model", default="small")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="", help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per sequence")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="timed steps per row")
    p.add_argument("--out", default="", help=f"JSON file (on a GPU, default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_cuda_graphs: no CUDA device here (--device cpu checks the script)")
        return 0
    header = record()
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    model = load_model(args.model, dtype, dev)
    bs = args.block_size
    width = args.context // bs + 1
    cache = model.allocate_kv_cache(max(batches) * width, bs)
    cache.normal_(std=0.5)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            step = Step(model, cache, bs, batch, args.context)
            row: dict[str, Any] = {"batch": batch, "eager_ms": timed(step.eager, args.steps)}
            if dev.type == "cuda":
                step.capture()
                assert step.replay() == step.eager(), "the graph's tokens differ from eager's"
                row["graph_ms"] = timed(step.replay, args.steps)
            best = row.get("graph_ms", row["eager_ms"])
            row["tok_s"] = 1e3 * batch / best
            row["tok_s_per_user"] = 1e3 / best
            if "graph_ms" in row:
                row["graph_speedup"] = row["eager_ms"] / row["graph_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            del step
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    result = {
        **header,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "context_tokens": args.context,
        "block_size": bs,
        "rows": rows,
        "one_user_tok_s": rows[0]["tok_s_per_user"] if batches[0] == 1 else None,
        "seed_one_user_tok_s": SEED_ONE_USER_TOK_S,
        "seed_note": "DeepSeek-V4.1-Flash on GB300 NVL72 with MTP speculative decoding (vLLM)",
    }
    out = args.out or (DEFAULT_OUT if dev.type == "cuda" else "")
    if out:
        print(f"wrote {write_result(out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
