"""Decode attention on the CPU: the C kernel (``kernels/mla_decode/paged_cpu.c``) beside the torch
path it replaced, the op alone and whole decode steps (issue 31).

The op: ``tiny``'s shapes (8 heads, 64 + 16 latent dims, 64-token blocks scattered over the cache),
both implementations taking turns on the same inputs. The steps: two engines in one process, one
traced and run with ``FERRY_KERNELS=torch``'s choice and one with the default's, taking turns on
the same prompts (a batch of requests with a shared prefix and their own last token; the batch is
past the default ``max_graph_batch``, so the steps run eagerly, as a decode worker's do at 32
sessions). One torch thread, as a decode worker runs.

    make bench-decode-attention    # python loadtest/bench_decode_attention.py → decode-attention-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from engine_steps import decode_steps
from harness import record, write_result

from ferry.kernels import dispatch
from ferry.kernels.mla_decode.native_kernel import mla_decode_native
from ferry.kernels.mla_decode.reference import mla_decode_torch
from ferry.services.engine import Engine, EngineConfig

HEADS, RANK, ROPE, BLOCK = 8, 64, 16, 64  # tiny
# (name, context lengths of the batch)
OP_CASES = [
    ("1x600", [600]),
    ("8x1000", [1000] * 8),
    ("24x2000", [2000] * 24),
    ("16x200..4000", [200 + 253 * i for i in range(16)]),
]
IMPLS: dict[str, Callable[..., torch.Tensor]] = {"torch": mla_decode_torch, "c": mla_decode_native}


def op_inputs(lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    cache = torch.randn(sum(need) + 8, BLOCK, RANK + ROPE, generator=gen) * 0.5
    perm = torch.randperm(cache.shape[0], generator=gen)
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.long)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(len(lens), HEADS, RANK + ROPE, generator=gen)
    return q, cache, tables, torch.tensor(lens)


def time_op(lens: list[int], rounds: int, calls: int) -> dict[str, Any]:
    q, cache, tables, seq_lens = op_inputs(lens, len(lens))
    scale = (RANK + ROPE) ** -0.5
    outs = {n: fn(q, cache, tables, seq_lens, scale, RANK) for n, fn in IMPLS.items()}
    ms: dict[str, list[float]] = {n: [] for n in IMPLS}
    for _ in range(rounds):  # the two take turns: the machine's noise falls on both
        for name, fn in IMPLS.items():
            started = time.perf_counter()
            for _ in range(calls):
                fn(q, cache, tables, seq_lens, scale, RANK)
            ms[name].append((time.perf_counter() - started) / calls * 1e3)
    row = {f"{n}_ms": statistics.median(v) for n, v in ms.items()}
    row["speedup"] = row["torch_ms"] / row["c_ms"]
    row["max_abs_diff"] = float((outs["torch"] - outs["c"]).abs().max())
    return row


def time_steps(batch: int, prompt_len: int, rounds: int, tokens: int) -> dict[str, Any]:
    prompt = [(7 * j) % 249 + 1 for j in range(prompt_len)]
    backends = {"torch": "torch", "c": "auto"}
    engines = {}
    for name, backend in backends.items():
        dispatch.set_backend(backend)  # read when each op resolves: at every eager call
        engines[name] = Engine(EngineConfig(model="tiny"))
        decode_steps(engines[name], prompt, 8, batch)  # warm-up
    ms: dict[str, list[float]] = {n: [] for n in engines}
    for round_ in range(rounds):
        own = [(t + round_) % 249 + 1 for t in prompt]
        for name, engine in engines.items():
            dispatch.set_backend(backends[name])
            steps = decode_steps(engine, own, tokens, batch)
            ms[name].append(statistics.median(s for s, _ in steps) * 1e3)
    dispatch.set_backend("auto")
    row: dict[str, Any] = {f"{n}_ms_per_step": statistics.median(v) for n, v in ms.items()}
    row["speedup"] = row["torch_ms_per_step"] / row["c_ms_per_step"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--step-batch", type=int, default=24)
    p.add_argument("--step-prompt-len", type=int, default=2000)
    p.add_argument("--out", default="loadtest/results/decode-attention-cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {**record(torch_threads=args.threads), "op": {}}
    with torch.inference_mode():
        for name, lens in OP_CASES:
            row = time_op(lens, args.rounds, 10)
            result["op"][name] = row
            print(
                f"op {name}: torch {row['torch_ms']:.3f} ms, C {row['c_ms']:.3f} ms "
                f"({row['speedup']:.2f}x), max |diff| {row['max_abs_diff']:.1e}"
            )
    steps = time_steps(args.step_batch, args.step_prompt_len, args.rounds, 32)
    result["steps"] = {"batch": args.step_batch, "prompt_len": args.step_prompt_len, **steps}
    print(
        f"decode step, {args.step_batch} x {args.step_prompt_len}: torch "
        f"{steps['torch_ms_per_step']:.1f} ms, C {steps['c_ms_per_step']:.1f} ms "
        f"({steps['speedup']:.2f}x)"
    )
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
