"""Does a worker's UCX probe see the wedge that a peer killed mid-transfer can leave?

A UCX importer on shared memory whose exporter is SIGKILLed during pulls can end up unable to
complete any new handshake (see services/kv_transfer/ucx.py, UCX_DEFAULTS). Workers probe for
that every --kv-probe-interval (`UcxTransport.probe`: a connection to a listener of their own)
and restart when it fails. This reproduces the wedge the fastest way known (polling progress, a
new event loop per kill) in fresh importer processes, one per trial: each kills exporter after
exporter mid-pull until a pull from a fresh exporter cannot connect, and probes itself before
every kill (a failure there would be a false alarm) and once wedged (it should fail).

    python loadtest/ucx_wedge.py                 # writes loadtest/results/ucx_wedge.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from harness import record, write_result

from ferry.services.kv_transfer.ucx import UCX_DEFAULTS, UCX_SERVICE_DEFAULTS

LAYERS, BLOCKS, BS, DIM = 4, 256, 16, 1024  # 64 KiB per block and layer: 64 MB a pull
PROBE_TIMEOUT_S = 5.0


def exporter() -> tuple[subprocess.Popen[str], list[Any]]:
    from ferry.services.kv_transfer.handle import KvHandle

    cmd = [
        sys.executable,
        "-m",
        "ferry.services.kv_transfer.synthetic_exporter",
        "--transport",
        "ucx",
        "--layers",
        str(LAYERS),
        "--blocks",
        str(BLOCKS),
        "--block-size",
        str(BS),
        "--dim",
        str(DIM),
        "--sizes",
        ",".join(["256"] * 200),
        "--contiguous",
        "--reuse-blocks",
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, [KvHandle.from_json(json.dumps(h)) for h in info["handles"]]


def trial(max_kills: int, one_loop: bool) -> dict[str, Any]:
    """One importer process: kill exporters under it until it is wedged (or max_kills)."""
    import torch

    from ferry.services.engine.kv_cache import KVCacheManager
    from ferry.services.kv_transfer.endpoints import KvImporter
    from ferry.services.kv_transfer.handle import LayoutFingerprint, TransferError
    from ferry.services.kv_transfer.ucx import UcxTransport

    cache, kv = torch.zeros(LAYERS, BLOCKS, BS, DIM), KVCacheManager(BLOCKS, BS)
    layout = LayoutFingerprint.latent("test-model", "float32", LAYERS, DIM, BS)
    report: dict[str, Any] = {"kills": 0, "wedged": False, "false_alarms": 0, "probe_ms": []}

    async def once(proc: subprocess.Popen[str], handles: list[Any]) -> bool:
        imp = KvImporter(UcxTransport(), cache, kv, layout, transfer_timeout=10.0)
        try:
            await imp.pull(handles[0], None)
            imp.kv.release_hold(imp.hold_key(handles[0]))
        except TransferError as e:  # a fresh exporter: only this process can be at fault
            started = time.monotonic()
            problem = await imp.transport.probe(PROBE_TIMEOUT_S)
            report.update(
                wedged=True,
                pull_error=e.reason,
                probe_when_wedged=problem,
                probe_when_wedged_s=round(time.monotonic() - started, 3),
            )
            return True
        started = time.monotonic()
        if await imp.transport.probe(PROBE_TIMEOUT_S):
            report["false_alarms"] += 1
        report["probe_ms"].append(round((time.monotonic() - started) * 1000, 1))

        async def pull_rest() -> None:
            for h in handles[1:]:
                await imp.pull(h, None)
                imp.kv.release_hold(imp.hold_key(h))

        pulls = asyncio.create_task(pull_rest())
        await asyncio.sleep(0.3)  # into the 64 MB pulls
        os.kill(proc.pid, signal.SIGKILL)
        report["kills"] += 1
        with contextlib.suppress(TransferError):  # its exporter was killed under it
            await pulls
        await imp.transport.close()
        return False

    async def every_kill() -> None:  # as a worker lives: one event loop throughout
        for _ in range(max_kills + 1):
            proc, handles = exporter()
            try:
                if await once(proc, handles):
                    return
            finally:
                proc.kill()
                proc.wait()

    if one_loop:
        asyncio.run(every_kill())
        return report
    for _ in range(max_kills + 1):
        proc, handles = exporter()
        try:
            if asyncio.run(once(proc, handles)):  # a new event loop per kill
                break
        finally:
            proc.kill()
            proc.wait()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-kills", type=int, default=12)
    parser.add_argument("--out", default="loadtest/results/ucx_wedge.json")
    parser.add_argument(
        "--services-mode",
        action="store_true",
        help="ucxx as workers run it: progress thread with futures, one event "
        "loop for every kill (it wedges far less often)",
    )
    parser.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:  # the child: one trial, its report on the last line
        print("REPORT " + json.dumps(trial(args.max_kills, args.services_mode)), flush=True)
        os._exit(0)  # a wedged ucxx can hang a normal interpreter exit
    env = {**os.environ, **UCX_DEFAULTS}
    if args.services_mode:
        env.update(UCX_SERVICE_DEFAULTS)
    header = record(ucx_env={k: env[k] for k in env if "UC" in k})
    trials: list[dict[str, Any]] = []
    for i in range(args.trials):
        cmd = [sys.executable, __file__, "--trial", "--max-kills", str(args.max_kills)]
        cmd += ["--services-mode"] if args.services_mode else []
        child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in child.stdout.splitlines() if ln.startswith("REPORT ")]
        report: dict[str, Any] = (
            json.loads(lines[-1].removeprefix("REPORT "))
            if lines
            else {"error": f"exit {child.returncode}", "stderr": child.stderr[-2000:]}
        )
        print(f"trial {i}: {report}", flush=True)
        trials.append(report)
    wedged = [t for t in trials if t.get("wedged")]
    out = {
        **header,
        "services_mode": args.services_mode,
        "summary": {
            "trials": len(trials),
            "wedged": len(wedged),
            "kills_until_wedged": [t["kills"] for t in wedged],
            "probe_saw_the_wedge": sum(bool(t.get("probe_when_wedged")) for t in wedged),
            "false_alarms": sum(t.get("false_alarms", 0) for t in trials),
        },
        "trials": trials,
    }
    write_result(args.out, out)
    print(json.dumps(out["summary"]), f"\nwrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
