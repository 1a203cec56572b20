"""Control-plane overhead: 64 concurrent greedy requests through a `ferry up` cluster against the
same requests in one in-process Engine, on the same machine, in one run.

The cluster is the real thing: a private redis-server, prefill and decode workers and the
scheduler as separate processes, KV over the chosen transport, the client speaking gRPC to the
scheduler. Output tokens/s counts the tokens each request asked for (ignore_eos) over the wall
time from the first request sent to the last token received.

Two in-process baselines run in the same process as the client, one after the other:
- ``matched``: the engine with as many torch threads as one cluster worker has (default 1).
  Every engine then has the same compute, so the ratio is what the services add around them
  (gRPC, Redis, the KV transfer, the scheduler) plus the cost of splitting a request in two.
- ``all cores``: the engine with torch's default threads (every core). On a host with fewer
  cores than workers the cluster cannot match it: a prefill and a decode worker each get one
  core, and a request's path (its prefill, then all its decode steps) runs on one core at a
  time, while the in-process engine runs every step on all of them.

The measurement runs ``--rounds`` times, alternating cluster and in-process on fresh prompts
(no prefix-cache hits across rounds); the ratios are the medians of the per-round ratios.

    python loadtest/bench_services.py                   # tiny model, 1 prefill + 1 decode, ucx
    python loadtest/bench_services.py --model small --decode 2 --kv-transport grpc
    python loadtest/bench_services.py --model v4-tiny   # DeepSeek-V4: services-v4-tiny.json

Beside the rates it records the KV bytes the decode workers received per request (V4's include
each request's state slot) and the share of prompt tokens the prefix cache served.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import grpc
import torch
from harness import launched, record, services_metrics, write_result

from ferry.infra.launcher import ClusterSpec, Launcher
from ferry.infra.ports import free_port
from ferry.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from ferry.services.engine import Engine, EngineConfig, SamplingParams


def workload(n: int, seed: int, prompt: tuple[int, int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=gen).tolist()
    return [torch.randint(1, 250, (n_,), generator=gen).tolist() for n_ in lens]


def _rate(tokens: int, seconds: float, **extra: object) -> dict[str, object]:
    return {
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        **extra,
    }


def run_inprocess(
    engine: Engine, threads: int, prompts: list[list[int]], n: int
) -> dict[str, object]:
    torch.set_num_threads(threads)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == len(prompts) * n, tokens
    return _rate(tokens, seconds, threads=threads)


async def _one(
    stub: scheduler_pb2_grpc.SchedulerStub, prompt: list[int], n: int
) -> tuple[int, float, int]:
    """(output tokens, TTFT, prompt tokens the prefix cache served)."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
    sent = time.perf_counter()
    ttft, tokens, cached = 0.0, 0, 0
    async for chunk in stub.Generate(req):
        if not tokens:
            ttft = time.perf_counter() - sent
        tokens += len(chunk.token_ids)
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_tokens
    return tokens, ttft, cached


async def _drive(address: str, prompts: list[list[int]], n: int) -> dict[str, object]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        t = time.perf_counter()
        results = await asyncio.gather(*(_one(stub, p, n) for p in prompts))
        seconds = time.perf_counter() - t
    tokens = sum(r[0] for r in results)
    assert tokens == len(prompts) * n, tokens
    ttfts = sorted(r[1] for r in results)
    hit = sum(r[2] for r in results) / sum(len(p) for p in prompts)
    return _rate(
        tokens,
        seconds,
        ttft_p50_s=statistics.median(ttfts),
        ttft_max_s=ttfts[-1],
        prefix_cache_hit_rate=hit,
    )


def kv_bytes_moved(launcher: Launcher) -> float:
    """KV bytes the cluster's workers have received so far (their transfer counters)."""
    metrics = services_metrics(launcher.redis_url, launcher.spec.cluster)
    return sum(v for k, v in metrics.items() if k.startswith("ferry_kv_transfer_bytes_total"))


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    worker = ["--model", args.model, "--kv-transport", args.kv_transport, "--log-level", "warning"]
    if args.num_kv_blocks:
        worker += ["--num-kv-blocks", str(args.num_kv_blocks)]
    threads = ["--torch-threads", str(args.worker_threads)]
    return ClusterSpec(
        prefill=args.prefill,
        decode=args.decode,
        scheduler_port=free_port(),
        gateway=False,
        cluster="bench",
        serve_args={
            "prefill": [*worker, *threads],
            "decode": [*worker, *threads],
            "scheduler": ["--log-level", "warning"],
        },
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=64, help="all sent at once")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--kv-transport", default="ucx", choices=["ucx", "grpc"])
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="0: from memory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="default: loadtest/results/services[-MODEL].json")
    args = p.parse_args()
    suffix = "" if args.model == "tiny" else f"-{Path(args.model).name}"
    args.out = args.out or f"loadtest/results/services{suffix}.json"
    header = record()
    all_cores = torch.get_num_threads()
    n, span = args.output_len, tuple(args.prompt_len)
    warmup = workload(8, args.seed + 1000, span)

    engine = Engine(EngineConfig(model=args.model, num_kv_blocks=args.num_kv_blocks or None))
    engine.generate(warmup, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    spec = cluster_spec(args)
    address = f"{spec.host}:{spec.scheduler_port}"
    rounds = []
    with launched(spec) as launcher:
        asyncio.run(_drive(address, warmup, n))
        for r in range(args.rounds):
            prompts = workload(args.requests, args.seed + r, span)
            moved = kv_bytes_moved(launcher)
            cluster = asyncio.run(_drive(address, prompts, n))
            cluster["kv_bytes_per_request"] = (kv_bytes_moved(launcher) - moved) / len(prompts)
            row = {
                "cluster": cluster,
                "inprocess_matched": run_inprocess(engine, args.worker_threads, prompts, n),
                "inprocess_all_cores": run_inprocess(engine, all_cores, prompts, n),
            }
            rounds.append(row)
            print(
                f"round {r}: "
                + ", ".join(f"{k} {v['output_tokens_per_s']:.0f} tok/s" for k, v in row.items()),
                flush=True,
            )

    def median(key: str) -> float:
        return statistics.median(float(r[key]["output_tokens_per_s"]) for r in rounds)  # type: ignore[arg-type]

    def ratio(key: str) -> float:
        return statistics.median(
            float(r["cluster"]["output_tokens_per_s"]) / float(r[key]["output_tokens_per_s"])  # type: ignore[arg-type]
            for r in rounds
        )

    result = {
        **header,
        "workload": {
            "model": args.model,
            "requests": args.requests,
            "concurrent": args.requests,
            "prompt_len": list(span),
            "output_len": n,
            "greedy": True,
            "seed": args.seed,
            "rounds": args.rounds,
        },
        "cluster_config": {
            "prefill_workers": args.prefill,
            "decode_workers": args.decode,
            "kv_transport": args.kv_transport,
            "torch_threads_per_worker": args.worker_threads,
        },
        "cluster_tokens_per_s": median("cluster"),
        "inprocess_tokens_per_s": median("inprocess_matched"),
        "ratio": ratio("inprocess_matched"),
        "inprocess_threads": args.worker_threads,
        "inprocess_all_cores_tokens_per_s": median("inprocess_all_cores"),
        "ratio_all_cores": ratio("inprocess_all_cores"),
        "inprocess_all_cores_threads": all_cores,
        "kv_bytes_per_request": statistics.median(
            float(r["cluster"]["kv_bytes_per_request"])
            for r in rounds  # type: ignore[arg-type]
        ),
        "prefix_cache_hit_rate": statistics.median(
            float(r["cluster"]["prefix_cache_hit_rate"])
            for r in rounds  # type: ignore[arg-type]
        ),
        "target_ratio": 0.70,
        "rounds": rounds,
    }
    print(
        f"cluster / in-process ({args.worker_threads} thread(s), as a worker): "
        f"{result['ratio']:.0%} (target >= 70%); / in-process on all {all_cores} cores: "
        f"{result['ratio_all_cores']:.0%}"
    )
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
