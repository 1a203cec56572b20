"""A served load at levels of concurrency: each level its own sessions of an AgentX-like trace,
Locust headless (``locustfile.py``) playing them against a server for a fixed time, and the
client-side figures of its per-request log. ``sweep.py`` runs them against ``ferry up``
configurations, ``bench_peer.py`` against Ferry and llama.cpp's ``llama-server``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PERCENTILES = (50, 90, 99)
USER_CLASSES = {
    "chat": "AgentChatUser",
    "grpc": "AgentGrpcUser",
    "completions": "AgentCompletionsUser",
}


@dataclass(frozen=True)
class Level:
    concurrency: int
    sessions: tuple[int, int]  # [start, stop) of the trace's sessions


def plan_levels(concurrencies: list[int], duration_s: float) -> list[Level]:
    """Each level its own sessions: enough that none runs out (a session takes > 2 s)."""
    levels, start = [], 0
    for c in concurrencies:
        n = c * (math.ceil(duration_s / 2) + 1)
        levels.append(Level(c, (start, start + n)))
        start += n
    return levels


@dataclass(frozen=True)
class Server:
    """Where Locust sends the load: ``name`` names its files in the work folder."""

    name: str
    http: str  # http://host:port of the OpenAI API
    grpc: str = ""  # host:port of Ferry's public gRPC API (the ``grpc`` API's users)


def run_locust(
    server: Server,
    level: Level,
    trace: Path,
    *,
    duration_s: int,
    model: str,
    api: str,
    work_dir: Path,
) -> list[dict[str, Any]]:
    """Locust headless at this level; returns its per-request log (summary line last)."""
    c = level.concurrency
    prefix = work_dir / f"{server.name}-c{c}"
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless"]
    cmd += ["-u", str(c), "-r", str(c), "-t", f"{duration_s}s", "-s", "120"]
    cmd += ["--host", server.http, "--only-summary", "--csv", str(prefix), "--loglevel", "WARNING"]
    cmd += ["--agentx-trace", str(trace)]
    cmd += ["--agentx-sessions", f"{level.sessions[0]}:{level.sessions[1]}"]
    cmd += ["--agentx-log", f"{prefix}.jsonl", "--agentx-grpc-host", server.grpc]
    cmd += ["--agentx-model", model, USER_CLASSES[api]]
    with open(f"{prefix}.locust.log", "wb") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=HERE, check=False)
    return [json.loads(line) for line in Path(f"{prefix}.jsonl").read_text().splitlines()]


def level_stats(
    rows: list[dict[str, Any]], workers: int, ttft_slo: float, tpot_slo: float
) -> dict[str, Any]:
    """The client-side figures of one level from its per-request log rows."""
    ok = [r for r in rows if r["ok"]]
    if not ok:
        return {"requests": len(rows), "failed": len(rows)}
    span = max(r["sent_at"] + r["e2e"] for r in rows) - min(r["sent_at"] for r in rows)
    tokens = sum(r["completion_tokens"] for r in ok)
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    good = [r for r in ok if r["ttft"] <= ttft_slo and (r["tpot"] or 0) <= tpot_slo]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "seconds": span,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / span,
        "output_tokens_per_s_per_worker": tokens / span / workers,
        "tokens_per_s_per_user": 1 / float(np.median(tpots)) if tpots else None,
        "ttft_s": percentiles([r["ttft"] for r in ok]),
        "tpot_s": percentiles(tpots),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
        "goodput": len(good) / len(rows),
        "prompt_tokens_mean": prompt / len(ok),
        "prompt_tokens_max": max(r["prompt_tokens"] for r in ok),
        "prefix_cache_hit_rate": sum(r["cached_tokens"] for r in ok) / prompt,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    out = {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
    out["mean"] = float(np.mean(values))
    return out
