"""A private redis-server on a loopback port: the embedded default of ``ferry up``. It dies
with the process that started it."""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

from ferry.infra.children import popen_dying_with_parent


def redis_command(port: int, host: str = "127.0.0.1") -> list[str]:
    """``redis-server`` on ``host:port`` with no persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError(
            "redis-server is not installed: run `make setup` (apt-get install redis-server)"
        )
    return [
        exe,
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
        "--loglevel",
        "warning",
    ]


def redis_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    client = redis.Redis(
        host=host, port=port, socket_connect_timeout=timeout, socket_timeout=timeout
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def start_redis(
    port: int, host: str = "127.0.0.1", timeout: float = 10.0, cmd: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` (no persistence; ``cmd``: redis_command's, run another way) and
    wait until it answers PING."""
    cmd = cmd or redis_command(port, host)
    proc = popen_dying_with_parent(cmd, stdout=subprocess.DEVNULL)
    client = redis.Redis(host=host, port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode} (port {port})")
            try:
                if client.ping():
                    return proc
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"redis-server did not answer on {host}:{port}") from None
                time.sleep(0.05)
    finally:
        client.close()
