"""Which deployments and loads to simulate, the SLO search, and the outputs: simulation.json
and pareto.png.

With no deployment given, the sweep splits the GPUs between prefill and decode in steps of 8
(an HGX node, or two NVL72 compute trays), from 8 prefill GPUs up to two thirds of them; prefill
runs in DEP groups of 8, decode either as one wide DEP group over all its GPUs or in DEP groups
of 8; wide groups (32 ranks or more) get 32 redundant experts, as DeepSeek deploys them. Each
deployment is run at a concurrency sweep: one session, then 4 to 192 sessions per decode GPU,
up to the first load that adds less than 10% throughput.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ferry.infra.simulator.cluster import (
    Deployment,
    SimSetup,
    Simulation,
    Slice,
    feasibility,
    summarize,
)
from ferry.infra.simulator.workload import Workload

SESSIONS_PER_DECODE_GPU = (0, 4, 16, 64, 192)  # 0: a single session
WIDE_EP = 32  # DEP groups this wide get REDUNDANT experts by default
REDUNDANT = 32

# The seed's published points (issue 33): vLLM's *total* tokens/s per GPU (prompt tokens,
# cached ones included, plus output) on AgentX, and one user's speed on the small-batch path.
REFERENCE: list[dict[str, Any]] = [
    {
        "label": "vLLM: DeepSeek on 72 GB300, P/D + wide-EP, AgentX",
        "total_tok_s_per_gpu": 954_000,
        "tok_s_per_user_p90": 196,
        "metric": "total tokens/s per GPU (prompt, cached included, + output)",
    },
    {
        "label": "vLLM: one user, small-batch path, DeepSeek-V4.1-Flash",
        "tok_s_per_user": 826,
        "concurrency": 1,
        "metric": "output tokens/s of one user",
    },
]


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None  # p99 TTFT at most this
    tok_s_per_user: float | None  # p90 (the speed 90% of requests reach) at least this

    def met(self, point: dict[str, Any]) -> bool:
        ttft, speed = point["ttft_s"]["p99"], point["tok_s_per_user"]["p90"]
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        return self.tok_s_per_user is None or (speed is not None and speed >= self.tok_s_per_user)


def default_redundant(dep: int) -> int:
    return REDUNDANT if dep >= WIDE_EP else 0


def deployments(
    num_gpus: int,
    prefill_gpus: Sequence[int] = (),
    prefill_dep: Sequence[int] = (),
    decode_dep: Sequence[int] = (),
    redundant: int | None = None,
) -> list[Deployment]:
    """The deployments to simulate: the given sizes, the defaults where none are given.
    ValueError when nothing valid is left."""
    step = 8 if num_gpus >= 16 and num_gpus % 8 == 0 else 1
    splits = list(prefill_gpus) or list(range(step, num_gpus * 2 // 3 + 1, step))
    out: list[Deployment] = []
    bad: list[str] = []
    for p in splits:
        d = num_gpus - p
        if p < 1 or d < 1:
            bad.append(f"{p} prefill GPUs of {num_gpus}")
            continue
        p_deps = list(prefill_dep) or [math.gcd(p, 8)]
        d_deps = list(decode_dep) or sorted({math.gcd(d, 8), d})
        for pd, dd in itertools.product(p_deps, d_deps):
            red = default_redundant(dd) if redundant is None else redundant
            try:
                out.append(Deployment(p, pd, d, dd, red))
            except ValueError as exc:
                bad.append(str(exc))
    if not out:
        raise ValueError("no valid deployment: " + "; ".join(bad))
    return out


def loads(dep: Deployment, concurrency: Sequence[float] = ()) -> list[float]:
    """Deployment-wide concurrent sessions (closed loop) or arrival speed-ups (open loop)."""
    if concurrency:
        return list(concurrency)
    return [max(1.0, n * dep.decode_gpus) for n in SESSIONS_PER_DECODE_GPU]


# ---- running the points --------------------------------------------------------------------------

_JOB: tuple[SimSetup, Workload] | None = None  # for the forked workers


def _run_point(dep: Deployment, load: float) -> dict[str, Any]:
    assert _JOB is not None
    setup, workload = _JOB
    started = time.perf_counter()
    sim = Simulation(setup, dep, workload, load)
    sim.run()
    point = summarize(sim)
    key = "load_speedup" if workload.open_loop else "concurrency"
    value = load if workload.open_loop else sim.sessions / sim.slice.share
    return {
        "deployment": dep.to_dict(),
        key: value,
        **point,
        "wall_s": round(time.perf_counter() - started, 2),
    }


def _run_ladder(job: tuple[Deployment, list[float], bool]) -> list[dict[str, Any]]:
    """One deployment's loads, lightest first; with ``stop_saturated``, the ladder ends at the
    first load that adds less than 10% output throughput (the prefill or decode side is full:
    more load only lengthens the queues)."""
    dep, ladder, stop_saturated = job
    points: list[dict[str, Any]] = []
    for load in sorted(ladder):
        point = _run_point(dep, load)
        points.append(point)
        best = max((p["tok_s_per_gpu"] for p in points[:-1]), default=0.0)
        if stop_saturated and len(points) > 2 and point["tok_s_per_gpu"] < 1.1 * best:
            break
    return points


def run_points(
    setup: SimSetup,
    workload: Workload,
    jobs: list[tuple[Deployment, list[float]]],
    processes: int,
    stop_saturated: bool = True,
) -> list[dict[str, Any]]:
    """Every deployment's load ladder, deployments in parallel on ``processes`` forked
    workers; points in the order of ``jobs``."""
    global _JOB
    _JOB = (setup, workload)
    if not workload.open_loop:
        share = {d: Slice.of(d, setup.min_decode_ranks).share for d, _ in jobs}
        most = max(round(load * share[d]) for d, ladder in jobs for load in ladder)
        workload.prepare(2 * most)
    work = [(d, ladder, stop_saturated) for d, ladder in jobs]
    if processes > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            results = list(pool.imap(_run_ladder, work, chunksize=1))
    else:
        results = [_run_ladder(j) for j in work]
    return [p for ladder in results for p in ladder]


# ---- what the points say -------------------------------------------------------------------------


def frontier(points: Iterable[dict[str, Any]], y: str) -> list[dict[str, Any]]:
    """The Pareto frontier of (p90 tok/s per user, ``y``): no other point is better in both,
    in order of interactivity."""
    ranked = sorted(
        (p for p in points if p["tok_s_per_user"]["p90"] is not None),
        key=lambda p: (-p["tok_s_per_user"]["p90"], -p[y]),
    )
    out, best = [], -1.0
    for p in ranked:
        if p[y] > best:
            out.append(p)
            best = p[y]
    return out[::-1]


def best_point(points: list[dict[str, Any]], slo: Slo) -> dict[str, Any] | None:
    meeting = [p for p in points if slo.met(p)]
    return max(meeting, key=lambda p: p["tok_s_per_gpu"], default=None)


def compare_with_reference(points: list[dict[str, Any]], ttft_s: float | None) -> dict[str, Any]:
    """The simulator's answer at the seed's two published points, and the gap: the most total
    tok/s per GPU at p90 >= 196 tok/s per user (and the SLO's TTFT), the fastest single user."""
    seed, single = REFERENCE
    slo = Slo(ttft_s, seed["tok_s_per_user_p90"])
    fast = [p for p in points if slo.met(p)]
    at = max(fast, key=lambda p: p["total_tok_s_per_gpu"], default=None)
    lone = [p for p in points if p["simulated"]["sessions"] == 1]
    one = max(lone, key=lambda p: p["tok_s_per_user"]["p50"] or 0.0, default=None)
    timely = [p for p in points if Slo(ttft_s, None).met(p)]
    top = max((p["tok_s_per_user"]["p90"] or 0.0 for p in timely), default=0.0)
    out: dict[str, Any] = {"fastest_p90_tok_s_per_user_within_ttft": round(top, 1)}
    if at is None:
        out["agentx_at_p90_196"] = {
            "reached": False,
            "why": f"no simulated point reaches p90 {seed['tok_s_per_user_p90']} tok/s per user "
            f"with p99 TTFT <= {ttft_s} s (fastest: {top:.0f})",
        }
    else:
        out["agentx_at_p90_196"] = {
            "reached": True,
            "ttft_s_p99_at_most": ttft_s,
            "predicted_total_tok_s_per_gpu": round(at["total_tok_s_per_gpu"]),
            "predicted_tok_s_per_gpu": round(at["tok_s_per_gpu"]),
            "published_total_tok_s_per_gpu": seed["total_tok_s_per_gpu"],
            "ratio_published_over_predicted": round(
                seed["total_tok_s_per_gpu"] / max(at["total_tok_s_per_gpu"], 1e-9), 2
            ),
            "point": _brief(at),
        }
    if one is not None:
        speed = one["tok_s_per_user"]["p50"] or 0.0
        out["one_user"] = {
            "predicted_tok_s_per_user": round(speed, 1),
            "published_tok_s_per_user": single["tok_s_per_user"],
            "ratio_published_over_predicted": round(single["tok_s_per_user"] / max(speed, 1e-9), 2),
            "point": _brief(one),
        }
    return out


def _brief(p: dict[str, Any]) -> dict[str, Any]:
    keys = ("concurrency", "tok_s_per_gpu", "total_tok_s_per_gpu", "tok_s_per_user", "ttft_s")
    return {"deployment": p["deployment"]["label"]} | {k: p[k] for k in keys if k in p}


def skipped(setup: SimSetup, deps: list[Deployment], longest: int) -> list[dict[str, Any]]:
    out = []
    for d in deps:
        reason = feasibility(setup, d, longest)
        if reason:
            out.append({"deployment": d.to_dict(), "reason": reason})
    return out


def setup_dict(setup: SimSetup) -> dict[str, Any]:
    raw = asdict(setup)
    for k in ("hardware", "model", "efficiency"):
        raw.pop(k)
    return raw


# ---- the plot ------------------------------------------------------------------------------------


def plot(path: str, result: dict[str, Any]) -> None:
    """x: interactivity (p90 output tok/s per user); y: output tok/s per GPU (left) and total
    tok/s per GPU (right, prompt tokens counted, the seed's metric). Grey: every point (filled:
    within the SLO's TTFT); lines: the frontier of each deployment family and of all, over the
    points within the TTFT; star and dashed line: the seed's published points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = result["points"]
    ttft = result["slo"]["ttft_s_p99"]
    points = [p for p in every if Slo(ttft, None).met(p)]  # the frontiers' points
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.8))
    families: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        d = p["deployment"]
        family = "decode: one wide DEP group" if d["decode_groups"] == 1 else "decode: DEP8 groups"
        families.setdefault(family, []).append(p)
    for ax, y, title in (
        (axes[0], "tok_s_per_gpu", "output tok/s per GPU"),
        (axes[1], "total_tok_s_per_gpu", "total tok/s per GPU (prompt incl. cached + output)"),
    ):
        for group, style in (
            (every, {"facecolors": "none", "edgecolors": "0.75"}),
            (points, {"color": "0.6"}),
        ):
            shown = [p for p in group if p["tok_s_per_user"]["p90"]]
            label = "simulated points" if group is every else f"p99 TTFT <= {ttft} s"
            ax.scatter(
                [p["tok_s_per_user"]["p90"] for p in shown],
                [p[y] for p in shown],
                s=12,
                label=label,
                zorder=1,
                **style,
            )
        for (family, pts), color in zip(
            sorted(families.items()), ("tab:blue", "tab:orange"), strict=False
        ):
            f = frontier(pts, y)
            ax.plot(
                [p["tok_s_per_user"]["p90"] for p in f],
                [p[y] for p in f],
                "o-",
                ms=3,
                color=color,
                label=f"frontier, {family}",
                zorder=2,
            )
        f = frontier(points, y)
        ax.plot(
            [p["tok_s_per_user"]["p90"] for p in f],
            [p[y] for p in f],
            "-",
            lw=2.2,
            color="black",
            label="frontier, all",
            zorder=3,
        )
        for p in f[:: max(1, len(f) // 5)]:
            ax.annotate(
                p["deployment"]["label"],
                (p["tok_s_per_user"]["p90"], p[y]),
                fontsize=6,
                xytext=(4, 4),
                textcoords="offset points",
            )
        _mark_reference(ax, y)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("interactivity: p90 output tok/s per user (90% of requests at least)")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(
        f"ferry simulate: {result['model']['name']} on {result['settings']['gpus']} "
        f"{result['hardware']['name'].upper()}, {result['efficiency']} kernels, "
        f"{result['workload']['name']} workload (frontiers: p99 TTFT <= {ttft} s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _mark_reference(ax: Any, y: str) -> None:
    seed, single = REFERENCE
    if y == "total_tok_s_per_gpu":
        ax.scatter(
            [seed["tok_s_per_user_p90"]],
            [seed["total_tok_s_per_gpu"]],
            marker="*",
            s=220,
            color="tab:red",
            zorder=4,
            label="seed (published): 954k total tok/s/GPU @ p90 196",
        )
    ax.axvline(
        single["tok_s_per_user"],
        color="tab:red",
        ls="--",
        lw=1,
        label="seed (published): 826 tok/s, one user",
    )
