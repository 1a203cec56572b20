"""What each process of a running 1P1D cluster costs: resident memory, start-up time, and
whether it has torch loaded.

Starts ``ferry up`` (tiny preset, one prefill and one decode worker, a private redis-server) on
free ports (``harness.ferry_up``), waits until it is ready (its gateway answers), then reads each
process from /proc: ``VmRSS``, whether ``libtorch`` is mapped, and its start-up time (from the
process's start to its ``serving`` log line). The launcher (``ferry up`` itself) has no serving
line: its start-up is the time until it is ready. Several runs; the medians go to the output, with the
command that made them.

    python loadtest/process_footprint.py --label after --out loadtest/results/process_footprint.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from harness import ClusterConfig, ferry_up, record, write_result

CLK_TCK = os.sysconf("SC_CLK_TCK")
DEFAULTS = ClusterConfig("footprint", "ferry up's defaults: 1 prefill + 1 decode worker", ())


def boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def process_start(pid: int) -> float:
    """The process's start as a Unix time (1/CLK_TCK resolution)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return boot_time() + int(fields[19]) / CLK_TCK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def has_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def role_of(pid: int) -> tuple[str, str]:
    """(role, worker id) from ``... serve ROLE ... --worker-id NAME``; ("", "") otherwise."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    args = [a.decode() for a in argv if a]
    if "serve" not in args:
        return "", ""
    role = args[args.index("serve") + 1]
    name = args[args.index("--worker-id") + 1] if "--worker-id" in args else role
    return role, name


def serving_times(log: Path) -> dict[str, float]:
    """worker id (the gateway: "gateway") -> Unix time of its first ``serving`` line."""
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"serving"' not in line:
            continue
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            key = "gateway" if ev.get("role") == "gateway" else ev.get("worker_id", "")
            ts = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
            out.setdefault(key, ts)
    return out


def one_run(timeout_s: float) -> dict[str, dict[str, object]]:
    """Each process of one `ferry up` (its defaults: the tiny model, 1 prefill + 1 decode)."""
    with (
        tempfile.TemporaryDirectory(prefix="ferry-footprint-") as work_dir,
        ferry_up(
            DEFAULTS,
            "tiny",
            Path(work_dir),
            cluster=f"footprint-{os.getpid()}",
            timeout_s=timeout_s,
        ) as cluster,
    ):
        time.sleep(1.0)  # let heartbeats and first scrapes settle
        serving = serving_times(cluster.log)
        up = cluster.proc.pid
        procs: dict[str, dict[str, object]] = {
            "launcher": {"rss_mb": rss_mb(up), "torch": has_torch(up), "start_s": cluster.ready_s},
        }
        for pid in children(up):
            role, name = role_of(pid)
            if not role:
                continue
            start = serving.get(name)
            procs[role] = {
                "rss_mb": rss_mb(pid),
                "torch": has_torch(pid),
                "start_s": (start - process_start(pid)) if start else None,
            }
        return procs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--label", default="now", help="the key this run is stored under")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/process_footprint.json"))
    p.add_argument("--timeout", type=float, default=180.0)
    args = p.parse_args()
    header = record()
    runs = [one_run(args.timeout) for _ in range(args.runs)]
    summary: dict[str, dict[str, object]] = {}
    for role in runs[0]:
        rows = [r[role] for r in runs if role in r]
        starts = [float(s) for r in rows if (s := r["start_s"]) is not None]  # type: ignore[arg-type]
        summary[role] = {
            "rss_mb": round(statistics.median(float(r["rss_mb"]) for r in rows), 1),  # type: ignore[arg-type]
            "start_s": round(statistics.median(starts), 2) if starts else None,
            "torch_loaded": any(bool(r["torch"]) for r in rows),
        }
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result[args.label] = {**header, "runs": args.runs, "processes": summary}
    write_result(args.out, result)
    print(json.dumps(result[args.label], indent=2))


if __name__ == "__main__":
    main()
