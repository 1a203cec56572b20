"""Where one user's decode step goes, in-process, eager and compiled side by side (issue 31).

One request (a 600-token prompt, greedy, 128 tokens) through ``Engine.step()`` with 2 torch
threads, as llama.cpp runs with ``-t 2``, on two engines that take turns: one with
``enforce_eager=True``, one with the default compiled decode graphs. Per decode step: the whole
step, the model's forward (``StepStats.forward_s``, logits included) and the rest (planning, the
batch, sampling, output processing). Then ``torch.profiler`` over a few decode steps: how many
dispatcher operations and matrix products one step launches (a compiled graph's fused C++ loops
are not operators: only what it hands to ATen/BLAS counts), and which take the CPU time.
``--batch N``: N such requests decoding together (each user's ms per token is then the step's).

    python loadtest/profile_decode.py                   # tiny → profile-decode-tiny.json
    python loadtest/profile_decode.py --model v4-tiny   # → profile-decode-v4-tiny.json
    python loadtest/profile_decode.py --batch 8         # → profile-decode-tiny-b8.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from engine_steps import add_requests, decode_steps
from harness import record, write_result
from torch.profiler import ProfilerActivity, profile

from ferry.services.engine import Engine, EngineConfig

MODES = ("eager", "compiled")  # EngineConfig(enforce_eager=True), and the default
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::einsum")


def op_profile(engine: Engine, prompt: list[int], steps: int, batch: int = 1) -> dict[str, Any]:
    """Operators of ``steps`` decode steps (the prefill before them is left out)."""
    add_requests(engine, prompt, batch, steps + 1)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    top = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    total_us = sum(e.self_cpu_time_total for e in ops)
    return {
        "steps": steps,
        "aten_calls_per_step": sum(e.count for e in ops) / steps,
        "matmuls_per_step": sum(e.count for e in ops if e.key in MATMULS) / steps,
        "top_ops_by_self_cpu": [
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "share": e.self_cpu_time_total / total_us,
            }
            for e in top
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="", help="default: loadtest/results/profile-decode-MODEL.json")
    args = p.parse_args()
    header = record(torch_threads=args.threads)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(1, 250, (args.prompt_len,), generator=gen).tolist()
    engines = {}
    for mode in MODES:
        started = time.perf_counter()
        engine = Engine(EngineConfig(model=args.model, enforce_eager=mode == "eager"), log=print)
        print(f"{mode}: engine ready in {time.perf_counter() - started:.1f} s")
        decode_steps(engine, base, 16, args.batch)  # warm-up (no prefix hit below)
        engines[mode] = engine
    # the modes take turns, a fresh prompt each round: the machine's noise falls on both
    steps: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        prompt = [(t + round_) % 249 + 1 for t in base[1:]] + [7]
        for mode in MODES:
            steps[mode] += decode_steps(engines[mode], prompt, args.tokens, args.batch)
    result: dict[str, Any] = {
        **header,
        "model": args.model,
        "prompt_len": args.prompt_len,
        "batch": args.batch,
    }
    for mode in MODES:
        total = [s for s, _ in steps[mode]]
        ms = statistics.median(total) * 1e3
        fwd = statistics.median(f for _, f in steps[mode]) * 1e3
        prompt = [t % 248 + 2 for t in base]
        ops = op_profile(engines[mode], prompt, args.profile_steps, args.batch)
        result[mode] = {
            "decode_steps": len(total),
            "ms_per_token_median": ms,
            "forward_ms_median": fwd,
            "outside_forward_ms_median": ms - fwd,
            "outside_forward_share": (ms - fwd) / ms,
            "graph_steps": engines[mode].graphs.steps if engines[mode].graphs else 0,
            "operators": ops,
        }
        print(
            f"{args.model} {mode}: {ms:.2f} ms per token ({fwd:.2f} in the forward, "
            f"{(ms - fwd) / ms:.0%} outside); {ops['aten_calls_per_step']:.0f} tensor ops and "
            f"{ops['matmuls_per_step']:.0f} matrix products per step"
        )
        for row in ops["top_ops_by_self_cpu"][:8]:
            print(
                f"  {row['op']:<28} {row['calls_per_step']:6.1f} calls "
                f"{row['self_ms_per_step']:6.3f} ms {row['share']:5.1%}"
            )
    result["speedup"] = (
        result["eager"]["ms_per_token_median"] / result["compiled"]["ms_per_token_median"]
    )
    suffix = f"-b{args.batch}" if args.batch > 1 else ""
    out = write_result(
        args.out or f"loadtest/results/profile-decode-{args.model}{suffix}.json", result
    )
    print(f"compiled decode: {result['speedup']:.2f}x eager")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
