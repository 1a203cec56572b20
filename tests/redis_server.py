"""Test helper: a real redis-server on a free loopback port, restartable on the same port."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from ferry.infra.ports import free_port
from ferry.infra.redis_server import start_redis


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = start_redis(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """kill -9 and start an empty server on the same port."""
        self.stop()
        self.proc = start_redis(self.port)


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
