"""``ferry simulate``: a discrete-event simulation of a whole deployment (see cluster.py).

    ferry simulate --hardware gb300 --gpus 72 --model deepseek-v4-flash --out DIR

writes DIR/simulation.json (the command, hardware, model, calibration report, one point per
deployment and load, the best deployment under the SLO, the seed's published points and the
gap to them) and DIR/pareto.png (throughput per GPU against interactivity).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ferry.infra.simulator import sweep
from ferry.infra.simulator.calibration import KERNELS_JSON, efficiency
from ferry.infra.simulator.cluster import SimSetup
from ferry.infra.simulator.costs import MODELS, ModelShape, load_model
from ferry.infra.simulator.hardware import HARDWARE, get_hardware
from ferry.infra.simulator.workload import load_workload
from ferry.services.scheduler.policies import POLICIES


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command to ``ferry``'s sub-parsers."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate a whole deployment at rack scale (throughput vs interactivity)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(p)


def configure(p: argparse.ArgumentParser) -> None:
    hw = p.add_argument_group("hardware and model")
    hw.add_argument("--hardware", required=True, choices=list(HARDWARE), help="the GPU")
    hw.add_argument("--gpus", required=True, type=int, help="GPUs in the deployment")
    hw.add_argument(
        "--model",
        required=True,
        help=f"{', '.join(MODELS)}, or a HF config.json (or its directory): shapes only",
    )
    hw.add_argument(
        "--efficiency",
        default="calibrated",
        choices=["calibrated", "production"],
        help="calibrated: Ferry's kernels as measured on H100 (bf16); production: FP8/FP4 "
        "weights, FP8 KV and vLLM-class kernels' published efficiencies (default calibrated)",
    )
    hw.add_argument("--kernels-json", default=str(KERNELS_JSON), help="H100 measurements")
    d = p.add_argument_group("deployment (each a comma-separated list; none: a sweep)")
    d.add_argument("--prefill-gpus", type=_ints, default=[], help="GPUs for prefill")
    d.add_argument("--prefill-dep", type=_ints, default=[], help="prefill DEP group size")
    d.add_argument("--decode-dep", type=_ints, default=[], help="decode DEP group size")
    d.add_argument(
        "--redundant-experts",
        type=int,
        default=None,
        help=f"extra expert slots per DEP group (default {sweep.REDUNDANT} for groups of "
        f"{sweep.WIDE_EP} or more, else 0)",
    )
    d.add_argument("--no-dbo", action="store_true", help="no dual-batch overlap of all-to-all")
    d.add_argument("--policy", default="kv_aware", choices=list(POLICIES), help="routing")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default="", help="JSON-lines trace instead of AgentX sessions")
    w.add_argument(
        "--workload-scale",
        type=int,
        default=8,
        help="AgentX lengths × this (1: the 4,096-token presets' sizes; default 8: "
        "contexts up to 32K, ~580-token replies)",
    )
    w.add_argument(
        "--concurrency",
        type=_floats,
        default=[],
        help="concurrent sessions over the deployment (a trace: arrival speed-ups)",
    )
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("search and output")
    s.add_argument("--slo-ttft-s", type=float, default=2.0, help="p99 TTFT at most (default 2)")
    s.add_argument(
        "--slo-tok-s-per-user",
        type=float,
        default=100.0,
        help="p90 output tok/s per user at least (default 100)",
    )
    s.add_argument(
        "--duration-s", type=float, default=40.0, help="simulated seconds per point, at most"
    )
    s.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    s.add_argument("--out", required=True, help="directory for simulation.json and pareto.png")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as exc:
        print(f"ferry simulate: error: {exc}", file=sys.stderr)
        return 2


def _setup(args: argparse.Namespace) -> tuple[SimSetup, ModelShape]:
    if args.gpus < 2:
        raise ValueError("--gpus must be at least 2 (one prefill and one decode GPU)")
    if args.duration_s <= 10:
        raise ValueError("--duration-s must be more than 10 (6 s of warm-up, then the window)")
    model = load_model(args.model)
    hw = get_hardware(args.hardware)
    if args.efficiency == "calibrated" and not Path(args.kernels_json).is_file():
        raise ValueError(f"--kernels-json {args.kernels_json}: no such file")
    eff = efficiency(args.efficiency, Path(args.kernels_json))
    block = 256 if model.family == "v4" else 64
    setup = SimSetup(
        hw,
        model,
        eff,
        policy=args.policy,
        block_size=block,
        dbo=not args.no_dbo,
        duration_s=args.duration_s,
        seed=args.seed,
    )
    return setup, model


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    setup, model = _setup(args)
    workload = load_workload(args.trace or None, args.workload_scale, args.seed)
    deps = sweep.deployments(
        args.gpus, args.prefill_gpus, args.prefill_dep, args.decode_dep, args.redundant_experts
    )
    longest = _longest(workload, model)
    skipped = sweep.skipped(setup, deps, longest)
    bad = {json.dumps(s["deployment"], sort_keys=True) for s in skipped}
    deps = [d for d in deps if json.dumps(d.to_dict(), sort_keys=True) not in bad]
    if not deps:
        raise ValueError(f"no deployment fits: {skipped[0]['reason']}")
    jobs = [(d, sweep.loads(d, args.concurrency)) for d in deps]
    print(f"ferry simulate: {len(deps)} deployments", file=sys.stderr)
    points = sweep.run_points(
        setup, workload, jobs, max(1, args.processes), stop_saturated=not args.concurrency
    )
    slo = sweep.Slo(args.slo_ttft_s, args.slo_tok_s_per_user)
    best = sweep.best_point(points, slo)
    result = _result(args, setup, model, workload, points, skipped, slo, best)
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(json.dumps(result, indent=1) + "\n")
    sweep.plot(str(out / "pareto.png"), result)
    _print_summary(result, out)
    return 0


def _longest(workload: Any, model: ModelShape) -> int:
    """The longest request (prompt + output) the deployment must hold, from a sample."""
    n = workload.num_sessions or 20
    reqs = [r for i in range(min(n, 20)) for r in workload.session(i)]
    return max((r.prompt_len + r.max_tokens for r in reqs), default=1)


def _result(
    args: argparse.Namespace,
    setup: SimSetup,
    model: ModelShape,
    workload: Any,
    points: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    slo: sweep.Slo,
    best: dict[str, Any] | None,
) -> dict[str, Any]:
    eff, hw = setup.efficiency, setup.hardware
    argv = sys.argv[1:]
    flags = argv[argv.index("simulate") + 1 :] if "simulate" in argv else argv
    return {
        "command": "ferry simulate " + shlex.join(flags),
        "hardware": vars(hw),
        "model": {
            "name": model.name,
            "family": model.family,
            "total_params": model.total_params,
            "active_params": model.active_params,
            "kv_bytes_per_token": model.kv_bytes_per_token(eff.precision.kv),
            "state_bytes_per_request": model.state_bytes_per_request(eff.precision.kv),
        },
        "efficiency": eff.name,
        "precision": vars(eff.precision),
        "efficiency_classes": {k: vars(v) for k, v in eff.classes.items()},
        "calibration": eff.report or efficiency("calibrated", Path(args.kernels_json)).report,
        "workload": workload.describe(),
        "settings": {"gpus": args.gpus, **sweep.setup_dict(setup)},
        "metrics": {
            "tok_s_per_gpu": "output tokens per second per GPU (prefill and decode GPUs)",
            "total_tok_s_per_gpu": "prompt tokens (cached included) + output tokens, per s per GPU",
            "tok_s_per_user": "per request: (output tokens - 1) / (last token - first token); "
            "p90 is the speed 90% of requests reach (1 / p90 time per output token)",
            "ttft_s": "arrival to first token (prefill queue, prefill, no network)",
        },
        "points": points,
        "skipped": skipped,
        "slo": {"ttft_s_p99": slo.ttft_s, "tok_s_per_user_p90": slo.tok_s_per_user},
        "best": best,
        "reference": {
            "points": sweep.REFERENCE,
            "comparison": sweep.compare_with_reference(points, slo.ttft_s),
        },
    }


def _print_summary(result: dict[str, Any], out: Path) -> None:
    best = result["best"]
    slo = result["slo"]
    print(f"wrote {out / 'simulation.json'} and {out / 'pareto.png'} ({result['seconds']} s)")
    if best is None:
        print(
            f"no point meets the SLO (p99 TTFT <= {slo['ttft_s_p99']} s, p90 >= {slo['tok_s_per_user_p90']} tok/s/user)"
        )
        return
    print(
        f"best under the SLO: {best['deployment']['label']} at load {_load(best):.0f}: "
        f"{best['tok_s_per_gpu']:.0f} output tok/s/GPU ({best['total_tok_s_per_gpu']:.0f} total), "
        f"p90 {best['tok_s_per_user']['p90']:.0f} tok/s/user, p99 TTFT {best['ttft_s']['p99']:.2f} s"
    )


def _load(point: dict[str, Any]) -> float:
    return float(point.get("concurrency", point.get("load_speedup", 0.0)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ferry simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    configure(p)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
