"""Serving benchmark: AgentX-like agentic sessions at a list of concurrencies, per cluster
configuration, and the Pareto plots (``make bench-serve``).

For each configuration the sweep starts a cluster with ``ferry up``, warms it up, then runs
Locust headless (``locustfile.py``) once per concurrency for a fixed time (concurrency = live
sessions = Locust users). Every configuration replays the same trace (one written per sweep,
seeded), and each concurrency plays its own range of sessions, so no level starts with another
level's contexts in the prefix cache while the configurations see the same requests.

Per level it reports, from the client's per-request log: requests and failures, output tokens/s
(in all and per worker process), tokens/s per user (1 / median TPOT: interactivity), TTFT, TPOT,
ITL and end-to-end latency percentiles, goodput (the share of requests meeting ``--ttft-slo``
and ``--tpot-slo``) and the prefix-cache hit rate the clients saw; and from the servers: the
scheduler's prefix-cache hit rate, KV cache usage (sampled from the load reports in Redis),
KV bytes moved (in all and per request), and expert balancedness where a service exports it.

Writes ``loadtest/results/serve-<config>.json`` per configuration (``serve-<model>-<config>.json``
for a model other than ``tiny``: ``--model v4-tiny`` beside V3's), and for the configurations of
this run ``serve-pareto.png`` (output tokens/s per worker process against tokens/s per user, one
curve per configuration) and ``serve-ttft.png`` (TTFT p50 and p99 against concurrency).

    python loadtest/sweep.py                      # 4 configurations x 1,2,4,8 sessions x 30 s
    python loadtest/sweep.py --configs agg,1p1d --concurrency 1,4 --duration 20
    python loadtest/sweep.py --plot-only          # redraw from the results' JSON files
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
from agentx import WorkloadConfig, generate_sessions, summary, write_trace
from harness import (
    CONFIGS,
    WORKER_ROLES,
    ClusterConfig,
    RunningCluster,
    ferry_up,
    record,
    warm_up,
    write_result,
)
from levels import USER_CLASSES, Level, Server, level_stats, plan_levels, run_locust

from ferry.services.common.cluster_state import ClusterState

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIGS = ("agg", "1p1d", "1p2d", "1p-dep2")


# ---- one level -----------------------------------------------------------------------------
class KvSampler:
    """Samples every worker's KV usage (blocks in use / total) from its load reports."""

    def __init__(self, cluster: RunningCluster, every_s: float = 0.5) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        state = ClusterState(self.cluster.redis_url, self.cluster.cluster)
        try:
            while not self._stop.is_set():
                views = await state.workers()
                self.samples.append(
                    [
                        1 - v.load.free_kv_blocks / v.load.total_kv_blocks
                        for v in views
                        if v.record.role in WORKER_ROLES
                        and v.load is not None
                        and v.load.total_kv_blocks
                    ]
                )
                await asyncio.sleep(self.every_s)
        finally:
            await state.close()

    def __enter__(self) -> KvSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict[str, float]:
        flat = [x for s in self.samples for x in s]
        return {
            "kv_usage_mean": float(np.mean(flat)) if flat else 0.0,
            "kv_usage_max": max(flat, default=0.0),
        }


def measure_level(
    cluster: RunningCluster,
    level: Level,
    trace: Path,
    args: argparse.Namespace,
    workers: int,
    work_dir: Path,
) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    before = cluster.metrics()
    with KvSampler(cluster) as kv:
        server = Server(cluster.config.name, cluster.http, cluster.grpc)
        log = run_locust(
            server,
            level,
            trace,
            duration_s=args.duration,
            model=args.model,
            api=args.api,
            work_dir=work_dir,
        )
    after = cluster.metrics()
    rows, tail = [r for r in log if "summary" not in r], [r for r in log if "summary" in r]
    result = {
        "concurrency": level.concurrency,
        "sessions": list(level.sessions),
        "load_average_1m_before": load_before,
        **level_stats(rows, workers, args.ttft_slo, args.tpot_slo),
    }
    result["started"] = tail[0]["summary"]["started"] if tail else None
    result["unfinished"] = (result["started"] or 0) - len(rows)
    result["server"] = {**server_stats(before, after), **kv.stats()}
    if rows:  # the prompt's KV (and, for DeepSeek-V4, its state slot) per request
        result["server"]["kv_bytes_per_request"] = result["server"]["kv_transfer_bytes"] / len(rows)
    return result


def server_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the services' own metrics say about the level (counters as differences)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = delta("ferry_scheduler_prompt_tokens_total")
    ttft_n = delta("ferry_scheduler_time_to_first_token_seconds_count")
    out: dict[str, Any] = {
        "prefix_cache_hit_rate": delta("ferry_scheduler_cached_tokens_total") / prompt
        if prompt
        else None,
        "ttft_mean_s": delta("ferry_scheduler_time_to_first_token_seconds_sum") / ttft_n
        if ttft_n
        else None,
        "kv_transfer_bytes": sum(
            after[k] - before.get(k, 0.0)
            for k in after
            if k.startswith("ferry_kv_transfer_bytes_total")
        ),
        "retries": sum(
            after[k] - before.get(k, 0.0)
            for k in after
            if k.startswith("ferry_scheduler_retries_total")
        ),
    }
    balance = {k: v for k, v in after.items() if "balancedness" in k}
    if balance:  # present when a service exports it (the EPLB controller, DEP groups)
        out["expert_balancedness"] = balance
    return out


# ---- the sweep -----------------------------------------------------------------------------
def sweep_config(
    config: ClusterConfig,
    levels: list[Level],
    trace: Path,
    args: argparse.Namespace,
    common: dict[str, Any],
    work_dir: Path,
) -> dict[str, Any]:
    with ferry_up(config, args.model, work_dir) as cluster:
        workers = cluster.worker_processes()
        warm_up(cluster, args.model, max(2, workers))
        results = []
        for level in levels:
            row = measure_level(cluster, level, trace, args, workers, work_dir)
            print(f"{config.name} c={level.concurrency}: {_brief(row)}", flush=True)
            results.append(row)
    return {
        "config": config.name,
        "description": config.description,
        "ferry_up_args": list(config.args),
        "worker_processes": workers,
        **common,
        "levels": results,
    }


def _brief(row: dict[str, Any]) -> str:
    if "ttft_s" not in row:
        return f"{row['requests']} requests, all failed"
    return (
        f"{row['requests']} requests ({row['failed']} failed), "
        f"{row['output_tokens_per_s']:.0f} tok/s, {row['tokens_per_s_per_user']:.1f} tok/s/user, "
        f"TTFT p50 {row['ttft_s']['p50']:.2f}s p99 {row['ttft_s']['p99']:.2f}s, "
        f"goodput {row['goodput']:.0%}"
    )


TABLE_HEADER = (
    "| config | workers | c | requests | failed | unfinished | out tok/s | tok/s/worker "
    "| tok/s/user | TTFT p50 / p99 (s) | TPOT p50 (ms) | E2E p50 (s) | goodput "
    "| cache hit (client / server) | KV used max | balancedness |"
)


def table(results: list[dict[str, Any]]) -> str:
    """The results as the markdown table in loadtest/README.md (one row per level)."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for res in results:
        for row in res["levels"]:
            if "ttft_s" not in row:
                lines.append(
                    f"| {res['config']} | {res['worker_processes']} | "
                    f"{row['concurrency']} | {row['requests']} | all failed |"
                )
                continue
            server = row.get("server", {})
            balance = list((server.get("expert_balancedness") or {}).values())
            cells = [
                res["config"],
                res["worker_processes"],
                row["concurrency"],
                row["requests"],
                row["failed"],
                row.get("unfinished", "-"),
                f"{row['output_tokens_per_s']:.0f}",
                f"{row['output_tokens_per_s_per_worker']:.0f}",
                f"{row['tokens_per_s_per_user']:.0f}",
                f"{row['ttft_s']['p50']:.2f} / {row['ttft_s']['p99']:.2f}",
                f"{row['tpot_s']['p50'] * 1e3:.0f}",
                f"{row['e2e_s']['p50']:.2f}",
                f"{row['goodput']:.0%}",
                f"{row['prefix_cache_hit_rate']:.0%} / "
                f"{server.get('prefix_cache_hit_rate', float('nan')):.0%}",
                f"{server.get('kv_usage_max', float('nan')):.1%}",
                f"{min(balance):.2f}" if balance else "-",
            ]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    """The Pareto plot and the TTFT plot of these configurations' results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = _plot_title(results[0])
    pareto, ttft = out_dir / f"serve-{prefix}pareto.png", out_dir / f"serve-{prefix}ttft.png"
    fig, ax = plt.subplots(figsize=(7, 5))
    for res in results:
        pts = [lv for lv in res["levels"] if lv.get("tokens_per_s_per_user")]
        x = [lv["tokens_per_s_per_user"] for lv in pts]
        y = [lv["output_tokens_per_s_per_worker"] for lv in pts]
        (line,) = ax.plot(x, y, "o-", label=f"{res['config']}: {res['description']}")
        for lv, xi, yi in zip(pts, x, y, strict=True):
            ax.annotate(
                f"{lv['concurrency']}",
                (xi, yi),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
                color=line.get_color(),
            )
    ax.set(
        xlabel="tokens/s per user (1 / median TPOT)", ylabel="output tokens/s per worker process"
    )
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(pareto, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    for res in results:
        pts = [lv for lv in res["levels"] if "ttft_s" in lv]
        cs = [lv["concurrency"] for lv in pts]
        (line,) = ax.plot(
            cs, [lv["ttft_s"]["p50"] for lv in pts], "o-", label=f"{res['config']} p50"
        )
        ax.plot(
            cs,
            [lv["ttft_s"]["p99"] for lv in pts],
            "s--",
            color=line.get_color(),
            label=f"{res['config']} p99",
        )
    ax.set_xscale("log", base=2)
    levels = sorted({lv["concurrency"] for res in results for lv in res["levels"]})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set(xlabel="concurrency (live sessions)", ylabel="TTFT (s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(ttft, dpi=120)
    plt.close(fig)
    return [pareto, ttft]


def _plot_title(res: dict[str, Any]) -> str:
    """Two lines: what ran, and where (the machine note wrapped)."""
    m = res["machine"]
    where = f"{m['cpus']} CPUs" + (f"; {m['note']}" if m.get("note") else "")
    what = (
        f"AgentX-like sessions, {res['model']['preset']} model, "
        f"{res['duration_s']:.0f} s per concurrency"
    )
    return what + "\n" + textwrap.shorten(where, 90)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--concurrency", default="1,2,4,8", help="live sessions per level")
    p.add_argument("--duration", type=int, default=30, help="seconds per level")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: TTFT at most (s)")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="goodput: TPOT at most (s)")
    p.add_argument(
        "--api",
        default="chat",
        choices=sorted(USER_CLASSES),
        help="chat: OpenAI REST streaming; grpc: the Python SDK",
    )
    p.add_argument("--model", default="tiny", help="preset or checkpoint (`ferry up --model`)")
    p.add_argument("--max-context", type=int, default=4096, help="the model's max_model_len")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--work-dir", default="", help="keep traces, Locust CSVs, logs here")
    p.add_argument("--note", default="", help="recorded with the machine (e.g. 'shared host')")
    p.add_argument("--plot-only", action="store_true", help="redraw from --out-dir's JSON")
    p.add_argument(
        "--table",
        action="store_true",
        help="print --out-dir's JSON as the markdown table of loadtest/README.md",
    )
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(
            f"unknown configuration(s) {', '.join(sorted(unknown))}: choose of {', '.join(CONFIGS)}"
        )
    return args


def _prefix(model: str) -> str:
    """Results of the tiny preset keep their names; another model's are prefixed with it."""
    return "" if model == "tiny" else f"{Path(model).name}-"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    names = args.configs.split(",")
    if args.plot_only or args.table:
        files = [out_dir / f"serve-{_prefix(args.model)}{n}.json" for n in names]
        results = [json.loads(f.read_text()) for f in files if f.exists()]
        print(
            table(results)
            if args.table
            else " ".join(["wrote", *map(str, plot(results, out_dir, _prefix(args.model)))])
        )
        return
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="ferry-sweep-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    levels = plan_levels([int(c) for c in args.concurrency.split(",")], args.duration)
    workload = WorkloadConfig(seed=args.seed, max_context_tokens=args.max_context)
    sessions = generate_sessions(workload, 0, levels[-1].sessions[1])
    trace = work_dir / "agentx-trace.jsonl"
    write_trace(trace, workload, sessions)
    common = {
        **record(args.note),
        "model": {"preset": args.model, "max_model_len": args.max_context},
        "workload": {
            "generator": "loadtest/agentx.py",
            "config": workload.to_dict(),
            "shape": summary(sessions),
            "api": args.api,
            "trace_sha256": hashlib.sha256(trace.read_bytes()).hexdigest(),
            "greedy": True,
            "ignore_eos": True,
        },
        "duration_s": args.duration,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        res = sweep_config(CONFIGS[name], levels, trace, args, common, work_dir)
        path = write_result(out_dir / f"serve-{_prefix(args.model)}{name}.json", res)
        print(f"wrote {path}", flush=True)
        results.append(res)
    print(
        "wrote",
        *plot(results, out_dir, _prefix(args.model)),
        f"(traces, Locust CSVs and logs: {work_dir})",
    )


if __name__ == "__main__":
    main()
