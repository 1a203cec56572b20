"""What a request migration costs the client: concurrent greedy requests through a `ferry up`
cluster (1 prefill, 2 decode, --migration-limit 1), once undisturbed and once with one decode
worker killed (-9) mid-stream, on the same prompts, side by side in each trial. With
``--kill scheduler`` the cluster has two scheduler replicas behind the gateway, the requests
go through the gateway's gRPC API, and one scheduler is killed instead: its streams move
through the other (the gateway's migration).

Per request it records the gap from the first token (the prefill worker's) to the next chunk
(the hand-off to a decode worker), the longest gap after that (the stall a client sees) and the
tokens. The killed round must give every request all its tokens, equal to the undisturbed
round's (greedy); its longest stalls are those of the requests that moved (as many as the
scheduler's ``ferry_scheduler_migrations_total``, or the gateway's
``ferry_gateway_migrations_total``, grew): a second hand-off (prefill again with what was
generated, KV to a decode worker), set against the undisturbed hand-off and stalls.
Between trials the killed service is restarted by the launcher (its restart policy).

    python loadtest/bench_migration.py                  # tiny model, 3 trials of 8 requests
    python loadtest/bench_migration.py --kill scheduler --out loadtest/results/migration_scheduler.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import time
import urllib.request

import grpc
import torch
from harness import launched, record, write_result

from ferry.infra.launcher import ClusterSpec, Launcher
from ferry.infra.ports import free_port
from ferry.protos import common_pb2, ferry_pb2, ferry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

Stub = scheduler_pb2_grpc.SchedulerStub | ferry_pb2_grpc.FerryStub


async def _one(
    stub: Stub, prompt: list[int], n: int, progress: list[int], i: int
) -> dict[str, object]:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req: object = (  # the scheduler's API, or the gateway's
        scheduler_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
        if isinstance(stub, scheduler_pb2_grpc.SchedulerStub)
        else ferry_pb2.TextGenerateRequest(prompt_token_ids=prompt, sampling_params=params)
    )
    tokens: list[int] = []
    gaps: list[float] = []  # between chunks; the first is the prefill -> decode hand-off
    last, error = time.perf_counter(), ""
    try:
        async for chunk in stub.Generate(req):
            now = time.perf_counter()
            if tokens:
                gaps.append(now - last)
            last = now
            tokens += chunk.token_ids
            progress[i] = len(tokens)
    except grpc.aio.AioRpcError as e:
        error = f"{e.code().name}: {e.details()}"
    return {
        "tokens": tokens,
        "handoff_s": gaps[0] if gaps else 0.0,
        "max_gap_s": max(gaps[1:], default=0.0),
        "error": error,
    }


async def _round(
    address: str,
    gateway: bool,
    prompts: list[list[int]],
    n: int,
    kill: int = 0,
    victim: Launcher | None = None,
    name: str = "",
) -> tuple[list[dict[str, object]], float]:
    """All ``prompts`` at once; with ``kill``, SIGKILL service ``name`` once every request has
    ``kill`` tokens."""
    progress = [0] * len(prompts)
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Stub = (
            ferry_pb2_grpc.FerryStub(channel)
            if gateway
            else scheduler_pb2_grpc.SchedulerStub(channel)
        )
        t = time.perf_counter()
        tasks = [asyncio.create_task(_one(stub, p, n, progress, i)) for i, p in enumerate(prompts)]
        if kill and victim is not None:
            while min(progress) < kill and not all(task.done() for task in tasks):
                await asyncio.sleep(0.005)
            (child,) = [c for c in victim.children if c.name == name]
            os.kill(child.proc.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t


def _migrations(launcher: Launcher, by: str) -> float:
    """ferry_{by}_migrations_total of the scheduler, or of the gateway (its /metrics is on its
    HTTP port)."""
    (child,) = [c for c in launcher.children if c.role == by]
    port = child.metrics_port if by == "scheduler" else launcher.spec.gateway_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^ferry_{by}_migrations_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _serving(launcher: Launcher, name: str, timeout: float = 60) -> None:
    """Wait until the launcher's restart of ``name`` serves (its health check answers)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    (child,) = [c for c in launcher.children if c.name == name]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is None:
            try:
                with grpc.insecure_channel(child.address) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=1
                    )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    time.sleep(1.5)  # a heartbeat: the scheduler sees it again
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} was not restarted within {timeout:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=8, help="sent at once")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kill-after", type=int, default=32, help="tokens every request has first")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kill",
        choices=["decode", "scheduler"],
        default="decode",
        help="a decode worker (the scheduler moves its requests) or one of two "
        "scheduler replicas (the gateway moves its requests)",
    )
    p.add_argument("--out", default="loadtest/results/migration.json")
    args = p.parse_args()
    header = record()
    worker = ["--model", args.model, "--block-size", "16", "--log-level", "warning"]
    moves = ["--migration-limit", "1", "--log-level", "warning"]
    by_gateway = args.kill == "scheduler"
    spec = ClusterSpec(
        prefill=1,
        decode=2,
        schedulers=2 if by_gateway else 1,
        scheduler_port=free_port(),
        cluster="bench-migration",
        gateway=by_gateway,
        gateway_port=free_port(),
        grpc_port=free_port(),
        serve_args={
            "prefill": worker,
            "decode": worker,
            "scheduler": moves,
            "gateway": ["--model", args.model, *moves],
        },
    )
    address = f"{spec.host}:{spec.grpc_port if by_gateway else spec.scheduler_port}"
    mover = "gateway" if by_gateway else "scheduler"
    gen = torch.Generator().manual_seed(args.seed)
    trials = []
    with launched(spec, supervise=True) as launcher:  # its supervisor restarts the killed service
        for t in range(args.trials):
            prompts = [
                torch.randint(1, 250, (args.prompt_len,), generator=gen).tolist()
                for _ in range(args.requests)
            ]
            calm, calm_s = asyncio.run(_round(address, by_gateway, prompts, args.output_len))
            before = _migrations(launcher, mover)
            victim = f"{args.kill}-{t % 2}"
            hit, hit_s = asyncio.run(
                _round(
                    address, by_gateway, prompts, args.output_len, args.kill_after, launcher, victim
                )
            )
            moved = int(_migrations(launcher, mover) - before)
            gaps = sorted((float(r["max_gap_s"]) for r in hit), reverse=True)  # type: ignore[arg-type]
            calm_gaps = [float(r["max_gap_s"]) for r in calm]  # type: ignore[arg-type]
            handoffs = [float(r["handoff_s"]) for r in calm]  # type: ignore[arg-type]
            same = sum(a["tokens"] == b["tokens"] for a, b in zip(hit, calm, strict=True))
            row = {
                "killed": victim,
                "migrations": moved,
                "errors": [r["error"] for r in hit if r["error"]],
                "complete": sum(len(r["tokens"]) == args.output_len for r in hit),  # type: ignore[arg-type]
                "same_tokens_as_undisturbed": same,
                "undisturbed_handoff_median_s": statistics.median(handoffs),
                "undisturbed_max_stall_s": max(calm_gaps),
                "moved_max_gaps_s": gaps[:moved],
                "others_median_max_gap_s": statistics.median(gaps[moved:]) if gaps[moved:] else 0,
                "undisturbed_round_s": calm_s,
                "killed_round_s": hit_s,
            }
            trials.append(row)
            print(
                f"trial {t}: killed {victim}; {moved} moved, {row['complete']}/{args.requests} "
                f"complete, {row['same_tokens_as_undisturbed']} same tokens; stalls of the "
                f"moved {[round(g, 3) for g in gaps[:moved]]} s vs undisturbed hand-off "
                f"{statistics.median(handoffs):.3f} s, stall {max(calm_gaps):.3f} s; "
                f"round {hit_s:.2f} s vs {calm_s:.2f} s",
                flush=True,
            )
            _serving(launcher, victim)
    moved_gaps = [g for r in trials for g in r["moved_max_gaps_s"]]  # type: ignore[attr-defined]
    result = {
        **header,
        "workload": {
            "model": args.model,
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "kill_after_tokens": args.kill_after,
            "greedy": True,
            "killed": args.kill,
            "cluster": "1 prefill + 2 decode, ucx, --migration-limit 1"
            + (", 2 schedulers, requests through the gateway's gRPC API" if by_gateway else ""),
        },
        "moved_requests": len(moved_gaps),
        "moved_stall_median_s": statistics.median(moved_gaps) if moved_gaps else None,
        "undisturbed_handoff_median_s": statistics.median(
            float(r["undisturbed_handoff_median_s"]) for r in trials
        ),  # type: ignore[arg-type]
        "undisturbed_max_stall_median_s": statistics.median(
            float(r["undisturbed_max_stall_s"]) for r in trials
        ),  # type: ignore[arg-type]
        "all_complete_and_equal": all(
            r["complete"] == r["same_tokens_as_undisturbed"] == args.requests for r in trials
        ),
        "trials": trials,
    }
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
