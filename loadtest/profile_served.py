"""Where a served token's time goes (issue 31): one user's stream timed at each hop of the 1P1D
path, innermost first, against ``ferry up``'s defaults (1 prefill + 1 decode worker, 1 torch
thread each).

Each hop adds one layer to the one before it:

  engine         ``Engine.step()`` in this process (1 torch thread, compiled decode: a worker's)
  async_engine   ``AsyncEngine.stream`` in this process: + the engine thread → asyncio hand-off
  decode_worker  ``PrefillWorker.Prefill`` then ``DecodeWorker.Decode`` streamed straight here:
                 + the worker's servicer, protobuf and one gRPC message per chunk
  scheduler      ``Scheduler.Generate``: + the scheduler's relay
  gateway_grpc   the public ``Ferry.Generate``: + the gateway (its detokenizer, its relay)
  gateway_sse    ``POST /v1/completions`` streamed: + FastAPI, JSON and server-sent events

Per hop: TPOT (from the first token to the last, per token; medians over rounds, the hops taking
turns on fresh prompts), tokens per message, and the CPU each process spent per token while the
stream ran (``/proc``'s per-thread run time, ns resolution), the decode worker's by thread. The
difference between two hops' TPOT is what that layer adds to a token's latency; the CPU figures
say which process pays for it (on 2 cores, CPU spent anywhere slows the engine too).

    python loadtest/profile_served.py             # → loadtest/results/profile-served-tiny.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import requests
import torch
from harness import CONFIGS, RunningCluster, ferry_up, record, warm_up, write_result
from sse import sse_events

from ferry.protos import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    ferry_pb2,
    ferry_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from ferry.services.common.tokenizer import ByteTokenizer
from ferry.services.engine import AsyncEngine, Engine, EngineConfig, SamplingParams

HERE = Path(__file__).resolve().parent
HOPS = ("engine", "async_engine", "decode_worker", "scheduler", "gateway_grpc", "gateway_sse")


@dataclass
class Stream:
    """Arrival times of one request's messages and the tokens each carried."""

    on_first: Callable[[], Any]  # called when the first token arrives, and by finish()
    first_value: Any = None
    last_value: Any = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    total: int | None = None  # the usage's count, where messages do not say their tokens

    def got(self, tokens: int) -> None:
        if not tokens:
            return
        self.arrivals.append((time.perf_counter(), tokens))
        if len(self.arrivals) == 1:
            self.first_value = self.on_first()

    def finish(self) -> None:
        """The stream has ended (a hop whose threads end with it calls this before)."""
        if self.last_value is None:
            self.last_value = self.on_first()

    @property
    def tokens(self) -> int:
        return self.total if self.total is not None else sum(n for _, n in self.arrivals)

    def tpot_s(self) -> float:
        """Seconds per token after the first message's."""
        first, last = self.arrivals[0][0], self.arrivals[-1][0]
        return (last - first) / self.after_first

    @property
    def after_first(self) -> int:
        return max(1, self.tokens - self.arrivals[0][1])


class CpuMeter:
    """Run time of every thread of some processes, from ``/proc/PID/task/TID/schedstat``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}

    def sample(self) -> dict[str, dict[str, float]]:
        """{process: {thread name: seconds run so far}} (threads of one name summed)."""
        out: dict[str, dict[str, float]] = {}
        for name, proc in self.procs.items():
            threads: dict[str, float] = defaultdict(float)
            for t in proc.threads():
                base = f"/proc/{proc.pid}/task/{t.id}"
                try:
                    comm = Path(f"{base}/comm").read_text().strip()
                    run_ns = int(Path(f"{base}/schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                    continue
                threads[_thread_kind(comm)] += run_ns / 1e9
            out[name] = dict(threads)
        return out

    @staticmethod
    def spent(
        before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
    ) -> dict[str, dict[str, float]]:
        return {
            p: {t: max(0.0, s - before[p].get(t, 0.0)) for t, s in after[p].items()} for p in after
        }


def _thread_kind(comm: str) -> str:
    """Thread names with their numbers cut off (``grpc_global_tim`` stays as it is)."""
    return comm.rstrip("0123456789-_") or comm


# ---- the hops ------------------------------------------------------------------------------
def hop_engine(s: Stream, engine: Engine, prompt: list[int], tokens: int) -> Stream:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(f"engine-{time.monotonic_ns()}", prompt, params)
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            s.got(len(out.token_ids) - seen)
            seen = len(out.token_ids)
    return s


async def hop_async_engine(s: Stream, engine: Engine, prompt: list[int], tokens: int) -> Stream:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runner = AsyncEngine(engine)
    seen = 0
    try:
        async for outs in runner.stream(prompt, params):
            s.got(len(outs[-1].token_ids) - seen)
            seen = len(outs[-1].token_ids)
        s.finish()  # the engine thread's run time goes with the thread
    finally:
        runner.shutdown()
    return s


def _params(tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


async def hop_decode_worker(
    s: Stream, prefill: str, decode: str, prompt: list[int], tokens: int
) -> Stream:
    """What the scheduler does for a 1P1D request, done from here."""
    rid = f"profile-{time.monotonic_ns()}"
    async with grpc.aio.insecure_channel(prefill) as pch, grpc.aio.insecure_channel(decode) as dch:
        result = await prefill_worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(
            prefill_worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling_params=_params(tokens)
            )
        )
        s.got(len(result.first.token_ids))
        msg = decode_worker_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=_params(tokens),
            first_token_id=result.first.token_ids[0],
            kv_handle=result.kv_handle,
            num_cached_tokens=result.first.usage.cached_tokens,
        )
        async for chunk in decode_worker_pb2_grpc.DecodeWorkerStub(dch).Decode(msg):
            s.got(len(chunk.token_ids))
    return s


async def hop_stream(s: Stream, address: str, call: Callable[[Any], Any]) -> Stream:
    """A TokenChunk stream that ``call(channel)`` starts (the scheduler's, the gateway's)."""
    async with grpc.aio.insecure_channel(address) as ch:
        async for chunk in call(ch):
            s.got(len(chunk.token_ids))
    return s


def _scheduler_call(prompt: list[int], tokens: int) -> Callable[[Any], Any]:
    req = scheduler_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=_params(tokens))
    return lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Generate(req)


def _gateway_call(prompt: list[int], tokens: int) -> Callable[[Any], Any]:
    req = ferry_pb2.TextGenerateRequest(
        model="tiny", prompt_token_ids=prompt, sampling_params=_params(tokens)
    )
    return lambda ch: ferry_pb2_grpc.FerryStub(ch).Generate(req)


def hop_gateway_sse(s: Stream, url: str, text: str, tokens: int) -> Stream:
    """Text deltas do not say how many tokens they hold (a byte may wait for the rest of its
    character): each event counts one, the usage gives the total."""
    body = {
        "model": "tiny",
        "prompt": text,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as resp:
        resp.raise_for_status()
        for event in sse_events(resp):
            if event.get("choices"):
                s.got(1)
            if event.get("usage"):
                s.total = event["usage"]["completion_tokens"]
    return s


# ---- the measurement -----------------------------------------------------------------------
@dataclass
class Hops:
    """Every hop, ready to run one request into a Stream: hop name → (stream, prompt text)."""

    engine: Engine
    cluster: RunningCluster
    prefill: str
    decode: str
    tokens: int

    def runners(self) -> dict[str, Callable[[Stream, str], object]]:
        enc = ByteTokenizer().encode
        n, eng, c = self.tokens, self.engine, self.cluster
        return {
            "engine": lambda s, t: hop_engine(s, eng, enc(t), n),
            "async_engine": lambda s, t: asyncio.run(hop_async_engine(s, eng, enc(t), n)),
            "decode_worker": lambda s, t: asyncio.run(
                hop_decode_worker(s, self.prefill, self.decode, enc(t), n)
            ),
            "scheduler": lambda s, t: asyncio.run(
                hop_stream(s, c.scheduler, _scheduler_call(enc(t), n))
            ),
            "gateway_grpc": lambda s, t: asyncio.run(
                hop_stream(s, c.grpc, _gateway_call(enc(t), n))
            ),
            "gateway_sse": lambda s, t: hop_gateway_sse(s, c.http, t, n),
        }


def cluster_pids(cluster: RunningCluster) -> dict[str, int]:
    """The processes a served token passes through: `ferry up`'s children by role, and us."""
    pids = {"client": psutil.Process().pid}
    for child in psutil.Process(cluster.proc.pid).children():
        cmd = child.cmdline()
        if "serve" in cmd:
            pids[cmd[cmd.index("serve") + 1]] = child.pid
    return pids


def workers(cluster: RunningCluster) -> dict[str, str]:
    """role → gRPC address of the cluster's prefill and decode worker."""
    return {v.record.role: v.record.address for v in cluster.views()}


def prompts(n: int, length: int, seed: int) -> Iterator[str]:
    """Fresh ASCII prompts (no prefix hit from one to the next)."""
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(rng.choices(string.ascii_letters + " ", k=length))


def measure(hops: Hops, meter: CpuMeter, rounds: int, prompt_len: int) -> dict[str, Any]:
    runners = hops.runners()
    warm = prompts(len(HOPS), prompt_len, 1)
    for run in runners.values():  # first calls, channels, the graphs' shapes
        run(Stream(meter.sample), next(warm))
    samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    texts = prompts(rounds * len(HOPS), prompt_len, 0)
    for _ in range(rounds):
        for name in HOPS:
            s = Stream(meter.sample)
            runners[name](s, next(texts))
            s.finish()
            cpu = CpuMeter.spent(s.first_value, s.last_value)  # the decode, not the prefill
            if s.tokens != hops.tokens:
                raise RuntimeError(f"{name}: {s.tokens} tokens, asked for {hops.tokens}")
            samples[name].append(
                {
                    "tpot_s": s.tpot_s(),
                    "tokens_per_message": s.tokens / len(s.arrivals),
                    "cpu_per_token": {
                        p: {t: v / s.after_first for t, v in threads.items()}
                        for p, threads in cpu.items()
                    },
                }
            )
    return {name: _summary(samples[name]) for name in HOPS}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds."""
    cpu_us: dict[str, dict[str, float]] = {}
    for proc in rows[0]["cpu_per_token"]:
        kinds = {k for r in rows for k in r["cpu_per_token"][proc]}
        per = {
            k: statistics.median(r["cpu_per_token"][proc].get(k, 0.0) for r in rows) for k in kinds
        }
        cpu_us[proc] = {k: round(v * 1e6, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    return {
        "tpot_ms": statistics.median(r["tpot_s"] for r in rows) * 1e3,
        "tpot_ms_rounds": [r["tpot_s"] * 1e3 for r in rows],
        "tokens_per_message": statistics.median(r["tokens_per_message"] for r in rows),
        "cpu_us_per_token": {p: round(sum(t.values()), 1) for p, t in cpu_us.items()},
        "cpu_us_per_token_by_thread": {p: t for p, t in cpu_us.items() if sum(t.values()) > 1},
    }


def report(result: dict[str, Any]) -> str:
    lines = ["hop            TPOT ms   +ms   tok/msg  CPU µs per token (by process)"]
    prev = None
    for name in HOPS:
        h = result["hops"][name]
        added = "" if prev is None else f"{h['tpot_ms'] - prev:+.2f}"
        cpu = ", ".join(f"{p} {v:.0f}" for p, v in h["cpu_us_per_token"].items() if v >= 1)
        lines.append(
            f"{name:14} {h['tpot_ms']:7.2f} {added:>6} {h['tokens_per_message']:8.2f}  {cpu}"
        )
        prev = h["tpot_ms"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "profile-served-tiny.json"))
    p.add_argument("--work-dir", default="", help="keep ferry up's log here")
    args = p.parse_args()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="ferry-profile-served-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # as `ferry up` runs each worker (--torch-threads 1)
    engine = Engine(EngineConfig(model="tiny"), log=print)
    with ferry_up(CONFIGS["1p1d"], "tiny", work_dir) as cluster:
        warm_up(cluster, "tiny", 2)
        roles = workers(cluster)
        hops = Hops(engine, cluster, roles["prefill"], roles["decode"], args.tokens)
        meter = CpuMeter(cluster_pids(cluster))
        result: dict[str, Any] = {
            **record(),
            "served": "ferry up (defaults: 1 prefill + 1 decode worker, 1 torch thread each)",
            "prompt_len": args.prompt_len,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "hops": measure(hops, meter, args.rounds, args.prompt_len),
        }
    out = write_result(args.out, result)
    print(report(result))
    print(f"wrote {out} (ferry up's log: {work_dir})")


if __name__ == "__main__":
    main()
