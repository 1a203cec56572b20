"""Every listener has its port to itself: a taken port is a usage error (exit 2) that names
the port and the flag that moves it, found before the service loads anything."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from ferry.infra.ports import free_port, listens
from ferry.services.common.config import ServiceConfig
from ferry.services.common.listeners import PortInUse
from ferry.services.common.server import create_server
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.service import Scheduler


def _ferry(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-P", "-m", "ferry.infra.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return run, time.monotonic() - started


@contextmanager
def listening(reuse_port: bool = False) -> Iterator[int]:
    """A TCP port another process would find taken: held by a listening socket of this one
    (with SO_REUSEPORT, as gRPC's servers set it by default: a second such server would share)."""
    with socket.socket() as s:
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_grpc_server_does_not_share_its_port_with_another() -> None:
    """gRPC servers bind with SO_REUSEPORT unless told not to: ours are, so a port that another
    gRPC server holds (a second cluster on the same ports) is refused, not shared."""

    async def main() -> None:
        other = grpc.aio.server()  # default options, as any gRPC server's
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            config = ServiceConfig(port=port)
            with pytest.raises(PortInUse, match=rf"127\.0\.0\.1:{port}.*--port"):
                create_server(config, Scheduler(SchedulerConfig(service=config)))
        finally:
            await other.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("role", "flag"),
    [
        ("scheduler", "--port"),
        ("scheduler", "--metrics-port"),
        ("prefill", "--kv-port"),
        ("gateway", "--port"),
        ("gateway", "--grpc-port"),
    ],
)
def test_serve_on_a_taken_port_exits_2_naming_it(role: str, flag: str) -> None:
    with listening(reuse_port=True) as taken:
        args = ["serve", role, flag, str(taken)]
        if role == "gateway":  # its other port: any free one
            args += ["--grpc-port" if flag == "--port" else "--port", "0"]
        run, took = _ferry(*args)
    assert run.returncode == 2, run.stderr
    assert f"127.0.0.1:{taken}" in run.stderr and flag in run.stderr, run.stderr
    assert took < 10  # before loading a model or reaching Redis


def test_ferry_up_on_a_taken_port_exits_2_before_starting_anything() -> None:
    with listening(reuse_port=True) as taken:
        args = ["up", "--port", str(free_port()), "--grpc-port", str(free_port())]
        run, took = _ferry(*args, "--scheduler-port", str(taken))
    assert run.returncode == 2, run.stderr
    assert f"127.0.0.1:{taken}" in run.stderr and "--scheduler-port" in run.stderr, run.stderr
    assert "redis" not in run.stdout and took < 10


def test_listens_tells_the_process_that_holds_a_port() -> None:
    with listening() as port:
        assert listens(os.getpid(), port)
        assert not listens(os.getppid(), port)
    assert not listens(os.getpid(), port)
