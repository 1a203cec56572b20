"""Offline engine benchmark: Ferry's Engine against transformers' generate on the same weights.

Workload (seeded): N requests, prompt lengths uniform in 32..1024, output lengths uniform in
16..512, greedy, ignore_eos. Ferry runs all requests through one Engine (continuous batching);
transformers runs them in batches of 16 with left padding, each batch until its longest output.
Both count only the output tokens each request asked for. Two short Ferry runs hold 1 and 64
sequences in decode and measure the share of step time spent outside the model forward.

    python loadtest/bench_engine.py                      # the full workload (transformers: ~1 h here)
    python loadtest/bench_engine.py --hf-requests 32     # transformers on the first 32 requests only
    python loadtest/bench_engine.py --model v4-small     # DeepSeek-V4 -> results/engine-v4-small.json
    python loadtest/bench_engine.py --model v41-small --num-requests 64  # against v4-small

The result also has each model's KV cache per token and per request (the fixed part: DeepSeek-V4's
window and compressor rows), for the preset and the full-size model it stands for, V3 beside V4.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

import torch
from harness import record, write_result

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.model import PRESETS, export_preset
from ferry.services.engine.model.cache_spec import CacheSpec, PagedGroup
from ferry.services.engine.model.full_size import DEEPSEEK_V4_FLASH, DEEPSEEK_V41_FLASH
from ferry.services.engine.model.v4.config import V4ModelConfig
from ferry.services.engine.model.v4.kv_cache import v4_cache_spec
from ferry.services.engine.model.v41.config import V41ModelConfig
from ferry.services.engine.model.v41.kv_cache import v41_cache_spec
from ferry.services.engine.model.v41.quant import CacheFormat

# the full-size models the presets stand for (shapes only): bf16 caches, and V4.1's FP8 one
FULL_SIZE = {
    "deepseek-v3 (bf16)": CacheSpec((PagedGroup("latent", 61, 1, 512 + 64),)),
    "deepseek-v4-flash (bf16)": v4_cache_spec(DEEPSEEK_V4_FLASH),
    "deepseek-v4.1-flash (bf16)": v41_cache_spec(DEEPSEEK_V41_FLASH),
    "deepseek-v4.1-flash (fp8)": v41_cache_spec(DEEPSEEK_V41_FLASH, CacheFormat("fp8")),
}


# V4.1 has no transformers implementation: its baseline is V4's preset of the same size
AGAINST = {"v41-tiny": "v4-tiny", "v41-small": "v4-small"}


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p_len = int(torch.randint(32, 1025, (1,), generator=gen))
        o_len = int(torch.randint(16, 513, (1,), generator=gen))
        out.append((torch.randint(0, 256, (p_len,), generator=gen).tolist(), o_len))
    return out


def run_ferry(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    engine = Engine(_config(args, args.max_num_seqs))
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs)
    engine.check_integrity()
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        "preemptions": engine.num_preemptions,
    }


def outside_forward_share(
    args: argparse.Namespace, reqs: list[tuple[list[int], int]], batch: int
) -> dict[str, object]:
    """``batch`` requests in decode; time 30 steps, with a profile of the last ones. Warm-up
    first: the steps before the timed ones compile the decode graphs for this batch."""
    engine = Engine(_config(args, batch))
    for i, (prompt, _) in enumerate(reqs[:batch]):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
        )
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.requests.values()):
        engine.step()
    for _ in range(10):
        engine.step()
    total = forward = 0.0
    prof = cProfile.Profile()
    for i in range(30):
        if i >= 20:
            prof.enable()
        engine.step()
        prof.disable()
        stats = engine.last_step
        assert stats is not None and stats.num_seqs == batch
        total += stats.total_s
        forward += stats.forward_s
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return {
        "running_seqs": batch,
        "steps": 30,
        "step_ms": total / 30 * 1e3,
        "forward_ms": forward / 30 * 1e3,
        "share": 1 - forward / total,
        "profile_last_10_steps": buf.getvalue().splitlines()[:40],
    }


def run_hf(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        export_preset(args.model, d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    pad = 258
    tokens = 0
    t = time.perf_counter()
    for start in range(0, len(reqs), 16):
        batch = reqs[start : start + 16]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=pad,
            )
        tokens += sum(o for _, o in batch)
        print(
            f"  transformers: {start + len(batch)}/{len(reqs)} requests, {time.perf_counter() - t:.0f}s",
            flush=True,
        )
    seconds = time.perf_counter() - t
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
    }


def kv_bytes() -> dict[str, object]:
    """Per model: bytes per token of context (the paged groups) and per request (the state
    slot; a prefix-cache snapshot is the part of it a block boundary holds)."""

    def row(spec: CacheSpec, itemsize: int) -> dict[str, object]:
        return {
            "bytes_per_token": spec.bytes_per_token(itemsize),
            "bytes_per_request_fixed": spec.bytes_per_state_slot(itemsize),
            "bytes_per_prefix_snapshot": spec.bytes_per_snapshot(itemsize),
            "groups": spec.describe(itemsize),
        }

    out: dict[str, object] = {}
    for name, preset in PRESETS.items():
        c = preset.config
        if isinstance(c, V41ModelConfig):
            spec = v41_cache_spec(c)
            out[f"{name} (fp8)"] = row(v41_cache_spec(c, CacheFormat("fp8")), 4)
        elif isinstance(c, V4ModelConfig):
            spec = v4_cache_spec(c)
        else:
            spec = CacheSpec((PagedGroup("latent", c.num_hidden_layers, 1, c.kv_cache_dim),))
        out[f"{name} (float32)"] = row(spec, 4)
    for name, spec in FULL_SIZE.items():
        out[name] = row(spec, 2)
    return out


def _config(args: argparse.Namespace, max_num_seqs: int) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype="float32",
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=64,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--model", default="small")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=None, help="default: all; a multiple of 16")
    ap.add_argument(
        "--against",
        default=None,
        help="a preset to run through Ferry as the baseline instead of transformers "
        "(default for v41-*: the v4-* preset of the same size)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="Ferry's KV cache for --model (fp8: DeepSeek-V4.1); the baseline keeps its own",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: results/engine.json (small), else -MODEL")
    args = ap.parse_args()
    if args.out is None:
        suffix = "" if args.model == "small" else f"-{args.model}"
        suffix += "" if args.kv_cache_dtype == "auto" else f"-{args.kv_cache_dtype}"
        args.out = f"loadtest/results/engine{suffix}.json"
    header = record(threads=torch.get_num_threads())
    reqs = workload(args.num_requests, args.seed)
    shares = {}
    wide = min(64, len(reqs))
    for batch in (1, wide):
        print(f"ferry: outside-forward share at {batch} running sequences", flush=True)
        share = shares[batch] = outside_forward_share(args, reqs, batch)
        print(
            f"  step {share['step_ms']:.2f} ms, forward {share['forward_ms']:.2f} ms, "
            f"outside {share['share']:.1%}"
        )
    print(f"ferry: {len(reqs)} requests", flush=True)
    ferry = run_ferry(args, reqs)
    print(f"  {ferry['output_tokens_per_s']:.1f} output tokens/s ({ferry['seconds']:.0f}s)")
    against = args.against or AGAINST.get(args.model)
    if against:  # no transformers implementation: the other family's preset, through Ferry
        print(f"ferry {against}: {len(reqs)} requests", flush=True)
        theirs = {**vars(args), "model": against, "kv_cache_dtype": "auto"}
        base = run_ferry(argparse.Namespace(**theirs), reqs)
        baseline = {"model": against, "engine": "ferry", **base}
    else:
        hf_reqs = reqs[: args.hf_requests] if args.hf_requests else reqs
        print(f"transformers: {len(hf_reqs)} requests in batches of 16", flush=True)
        base = run_hf(args, hf_reqs)
        baseline = {"model": args.model, "engine": "transformers", **base}
        baseline |= {"batch_size": 16, "padding": "left"}
    print(f"  {base['output_tokens_per_s']:.1f} output tokens/s ({base['seconds']:.0f}s)")
    ratio = ferry["output_tokens_per_s"] / base["output_tokens_per_s"]
    print(
        f"ratio {args.model} / {baseline['model']} ({baseline['engine']}): {ratio:.2f}x; "
        f"outside-forward {shares[1]['share']:.1%} at 1, {shares[wide]['share']:.1%} at {wide}"
    )
    result = {
        **header,
        "workload": {
            "model": args.model,
            "dtype": "float32",
            "kv_cache_dtype": args.kv_cache_dtype,
            "requests": args.num_requests,
            "prompt_len": [32, 1024],
            "output_len": [16, 512],
            "seed": args.seed,
            "greedy": True,
        },
        "ferry": ferry,
        "baseline": baseline,
        "ratio": ratio,
        "outside_forward_at_1": shares[1],
        f"outside_forward_at_{wide}": shares[wide],
        "kv_cache": kv_bytes(),
        "targets": {"ratio": 5, "outside_forward_share": 0.10},
    }
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
