"""What the load-test and benchmark scripts share: a cluster to measure (``ferry up`` in a child
process, or the launcher in this one) on free ports, the record every result starts with (the
command, the date, the commit, the machine), and the results file.

The scripts run as ``python loadtest/NAME.py``, which puts this folder first on ``sys.path``:
they import this module as ``harness``, and no script imports another script.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ferry.infra.launcher import ClusterSpec, Launcher
from ferry.infra.ports import free_port
from ferry.services.common.cluster_state import ClusterState, WorkerView

ROOT = Path(__file__).resolve().parent.parent
WORKER_ROLES = ("prefill", "decode", "aggregated")


# ---- the record ----------------------------------------------------------------------------
def record(note: str = "", argv: list[str] | None = None, **machine_extra: Any) -> dict[str, Any]:
    """What every result starts with: ``command`` (``argv``: see :func:`command_line`), ``date``,
    ``git`` and ``machine``. Taken when the run starts: the load average is the one it started
    under."""
    return {
        "command": command_line(argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_commit(),
        "machine": machine(note, **machine_extra),
    }


def command_line(argv: list[str] | None = None) -> str:
    """The command that made a result, as run from the repository's root; ``argv``: the
    script's arguments when ``main(argv)`` was called rather than the script run."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else Path(sys.argv[0])
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", str(shown), *args])


def git_commit() -> str:
    """The checkout's short commit, "+changes" when code differs from it (results aside; ""
    outside a git checkout)."""
    run = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!loadtest/results"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return run.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def machine(note: str = "", **extra: Any) -> dict[str, Any]:
    """This machine; ``note``: what the person running it wants said of it (a shared host);
    ``extra``: what one script adds (its torch threads, its UCX settings)."""
    meminfo = _read("/proc/meminfo")
    kib = next((int(ln.split()[1]) for ln in meminfo.splitlines() if ln.startswith("MemTotal")), 0)
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in _read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(kib / 2**20, 1),
        "cpu_model": model,
        "gpu": _gpus(),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),  # without importing it: Locust's side has no torch
        "load_average_1m_at_start": os.getloadavg()[0],
        "note": note,
        **extra,
    }


def _read(path: str) -> str:
    return Path(path).read_text() if Path(path).exists() else ""


def _gpus() -> str | None:
    """The NVIDIA GPUs' names, comma-separated; None where there are none."""
    if shutil.which("nvidia-smi") is None:
        return None
    run = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    names = [n.strip() for n in run.stdout.splitlines() if n.strip()]
    return ", ".join(names) if run.returncode == 0 and names else None


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    """``result`` as indented JSON at ``path`` (its folder made); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


# ---- a `ferry up` cluster ------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterConfig:
    name: str
    description: str
    args: tuple[str, ...]  # `ferry up` flags


CONFIGS = {
    c.name: c
    for c in (
        ClusterConfig(
            "agg", "1 aggregated worker (prefill and decode in one engine)", ("--aggregated", "1")
        ),
        ClusterConfig("1p1d", "1 prefill + 1 decode worker", ("--prefill", "1", "--decode", "1")),
        ClusterConfig("1p2d", "1 prefill + 2 decode workers", ("--prefill", "1", "--decode", "2")),
        ClusterConfig(
            "1p-dep2",
            "1 prefill worker + a 2-rank DEP decode group",
            ("--prefill", "1", "--decode", "0", "--decode-dep", "2"),
        ),
        # prefix-aware routing against load-only routing, where there is a prefill choice to make
        ClusterConfig(
            "2p1d-kv",
            "2 prefill + 1 decode worker, kv_aware routing",
            ("--prefill", "2", "--decode", "1", "--routing-policy", "kv_aware"),
        ),
        ClusterConfig(
            "2p1d-ll",
            "2 prefill + 1 decode worker, least_loaded routing",
            ("--prefill", "2", "--decode", "1", "--routing-policy", "least_loaded"),
        ),
    )
}


@dataclass
class RunningCluster:
    config: ClusterConfig
    proc: subprocess.Popen[bytes]  # `ferry up` itself (the launcher)
    http: str  # http://host:port of the OpenAI API
    grpc: str  # host:port of the public gRPC API
    redis_url: str
    cluster: str
    log: Path
    scheduler: str  # host:port of the first scheduler's gRPC API
    ready_s: float  # from starting `ferry up` to its "ready" line

    def views(self) -> list[WorkerView]:
        return worker_views(self.redis_url, self.cluster)

    def worker_processes(self) -> int:
        return sum(v.record.role in WORKER_ROLES for v in self.views())

    def metrics(self) -> dict[str, float]:
        return services_metrics(self.redis_url, self.cluster)


@contextmanager
def ferry_up(
    config: ClusterConfig, model: str, work_dir: Path, cluster: str = "", timeout_s: float = 300.0
) -> Iterator[RunningCluster]:
    """``ferry up`` with this configuration on free ports, ready (its gateway answers); its
    output goes to ``work_dir/ferry-up-NAME.log``. Stopped with SIGTERM as a person would."""
    http, grpc_port, sched = free_port(), free_port(), free_port()
    cluster = cluster or f"bench-{config.name}"
    cmd = [str(Path(sys.executable).with_name("ferry")), "up", *config.args, "--model", model]
    cmd += ["--port", str(http), "--grpc-port", str(grpc_port), "--scheduler-port", str(sched)]
    cmd += ["--cluster", cluster]
    log = work_dir / f"ferry-up-{config.name}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        redis_url = _wait_ready(proc, log, timeout_s)
        yield RunningCluster(
            config,
            proc,
            f"http://127.0.0.1:{http}",
            f"127.0.0.1:{grpc_port}",
            redis_url,
            cluster,
            log,
            f"127.0.0.1:{sched}",
            time.monotonic() - started,
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    """Wait for `ferry up: ready` (printed once its gateway answers); returns the Redis URL it
    printed. Polled often: process_footprint.py times the launcher's start-up by it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "ferry up: ready" in text:
            line = next(ln for ln in text.splitlines() if ln.strip().startswith("redis "))
            return line.split()[1]
        if proc.poll() is not None:
            raise RuntimeError(f"ferry up exited with {proc.returncode}; see {log}")
        time.sleep(0.05)
    raise RuntimeError(f"ferry up not ready after {timeout_s:.0f}s; see {log}")


def warm_up(cluster: RunningCluster, model: str, n: int) -> None:
    """``n`` short concurrent requests, so that no measured request pays a first call's costs."""
    body = json.dumps(
        {
            "model": model,
            "max_tokens": 16,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "warm up " * 64}],
        }
    ).encode()

    def one() -> None:
        req = urllib.request.Request(
            f"{cluster.http}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as reply:
            reply.read()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- a cluster in this process ---------------------------------------------------------------
@contextmanager
def launched(spec: ClusterSpec, supervise: bool = False) -> Iterator[Launcher]:
    """``spec``'s cluster from the launcher in this process, every service healthy; with
    ``supervise``, its supervisor on a thread restarts what dies (its restart policy)."""
    launcher = Launcher(spec)
    try:
        launcher.start()
        if supervise:
            threading.Thread(target=launcher.wait, daemon=True).start()
        yield launcher
    finally:
        launcher.request_stop()
        launcher.stop()


# ---- what a cluster says of itself ---------------------------------------------------------
def worker_views(redis_url: str, cluster: str) -> list[WorkerView]:
    """Every registered service's record and last load report, read from Redis."""

    async def read() -> list[WorkerView]:
        state = ClusterState(redis_url, cluster)
        try:
            return await state.workers()
        finally:
            with contextlib.suppress(Exception):  # the views are read: closing cannot lose them
                await state.close()

    return asyncio.run(read())


def services_metrics(redis_url: str, cluster: str) -> dict[str, float]:
    """Every registered service's Prometheus samples, summed over the services."""
    totals: dict[str, float] = {}
    for v in worker_views(redis_url, cluster):
        if v.record.metrics_port > 0:
            for key, value in scrape(f"http://127.0.0.1:{v.record.metrics_port}/metrics"):
                totals[key] = totals.get(key, 0.0) + value
    return totals


def scrape(url: str) -> Iterator[tuple[str, float]]:
    """(sample name{labels}, value) of one /metrics page (nothing when it cannot be read)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            yield (f"{s.name}{{{labels}}}" if labels else s.name), float(s.value)
