"""Tile-size sweep for the Triton kernels whose speed hangs on it, at DeepSeek-V3's shapes.

    python -m kernels.tune                         # on a CUDA GPU; writes loadtest/results/kernel_tuning.json
    python -m kernels.tune --only mla_decode
    TRITON_INTERPRET=1 python -m kernels.tune --tiny   # tiny shapes on the CPU: checks the script

For each case of :mod:`kernels.bench`'s ``mla_decode``, ``fused_moe`` and ``prefill_attention``
suites, every candidate tiling below is checked against the float32 torch reference (as the bench
checks it) and timed (do_bench, median). A tiling that does not build (too much shared memory)
or gives a wrong answer is recorded as such. The table printed last gives, per case, the default
tiling's time and the fastest correct one's. Nothing is chosen at run time: the defaults in the
kernel modules are set by hand from these results, and the JSON keeps the evidence.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from ferry.kernels import bench, dispatch

DEFAULT_OUT = "loadtest/results/kernel_tuning.json"


def _decode_tilings() -> Iterator[Any]:
    from ferry.kernels.mla_decode.triton_kernel import DecodeBlocks

    for h, n, warps, stages in itertools.product((16, 32, 64), (32, 64), (4, 8), (2, 3)):
        yield DecodeBlocks(block_h=h, block_n=n, num_warps=warps, num_stages=stages)


def _moe_tilings() -> Iterator[Any]:
    from ferry.kernels.fused_moe.triton_kernel import MoEBlocks

    tiles = ((64, 64), (128, 64), (64, 128), (128, 128))
    for m, (n, k), warps in itertools.product((16, 32, 64, 128), tiles, (4, 8)):
        yield MoEBlocks(block_m=m, block_n=n, block_k=k, num_warps=warps)


def _prefill_tilings() -> Iterator[Any]:
    from ferry.kernels.mla_prefill.triton_kernel import PrefillBlocks

    for m, n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        yield PrefillBlocks(block_m=m, block_n=n, num_warps=warps, num_stages=stages)


TILINGS: dict[str, Callable[[], Iterator[Any]]] = {  # the weakest against its roofline first
    "mla_decode": _decode_tilings,
    "prefill_attention": _prefill_tilings,
    "fused_moe": _moe_tilings,
}
TINY_TILINGS = 2  # --tiny checks the script on the first few tilings only


def tune_case(case: bench.Case, tilings: list[Any]) -> dict[str, Any]:
    """The case's default tiling and every candidate, each checked and timed."""
    kernel = dispatch.implementation(case.op, "triton")
    reference = dispatch.implementation(case.op, "torch")(*bench._float32(case.args))
    row: dict[str, Any] = {"op": case.op, "shape": case.shape, "tilings": []}
    for tiling in [None, *tilings]:
        entry: dict[str, Any] = {"tiling": "default" if tiling is None else asdict(tiling)}
        kwargs = {} if tiling is None else {"blocks": tiling}
        try:
            entry["max_rel_err"] = case.compare(kernel(*case.args, **kwargs), reference)
            entry["ms"] = bench.time_ms(functools.partial(kernel, *case.args, **kwargs))
            entry["ok"] = True
        except Exception as exc:  # a tiling that does not build or is wrong: say so, go on
            entry |= bench.failure(exc)
        row["tilings"].append(entry)
    del reference
    timed = [t for t in row["tilings"] if t["ok"]]
    if timed:
        best = min(timed, key=lambda t: t["ms"])
        row["best"] = best["tiling"]
        row["best_ms"] = best["ms"]
        if row["tilings"][0]["ok"]:
            row["default_ms"] = row["tilings"][0]["ms"]
    return row


def _print_row(row: dict[str, Any]) -> None:
    shape = " ".join(f"{k}={v}" for k, v in row["shape"].items())
    failed = sum(not t["ok"] for t in row["tilings"])
    line = f"{row['op']:18s} {shape}\n    "
    if "default_ms" in row:
        line += f"default {row['default_ms']:8.3f} ms   "
    if "best" in row:
        line += f"best {row['best_ms']:8.3f} ms {row['best']}"
    print(f"{line}   ({failed} of {len(row['tilings'])} tilings failed)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--only", nargs="+", choices=list(TILINGS), help="ops to tune (default: all)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results JSON (default: {DEFAULT_OUT})")
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes, any device (checks the script)"
    )
    args = p.parse_args(argv)
    if (status := bench.pick_device(args.tiny, "tuning needs a GPU")) is not None:
        return status
    torch.manual_seed(0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "ferry.kernels.tune", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": bench._machine(),
        "complete": False,
        "results": [],
    }
    started = time.perf_counter()
    for op in args.only or list(TILINGS):
        tilings = list(TILINGS[op]())[: TINY_TILINGS if args.tiny else None]
        for case in bench.SUITES[op](args.tiny):
            row = tune_case(case, tilings)
            result["results"].append(row)
            result["seconds"] = round(time.perf_counter() - started, 1)
            out.write_text(json.dumps(result, indent=2) + "\n")
            _print_row(row)
        if bench.DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    result["complete"] = True
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['seconds']} s)")
    return 0 if all("best" in r for r in result["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
