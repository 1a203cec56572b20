"""Every listener of a Ferry process has its port to itself. gRPC servers share a port with
any other that asks for SO_REUSEPORT, which gRPC does by default: a second cluster on the same
ports would answer the first one's clients. Ours turn it off, and a taken port is a usage error
that names the port and the flag that moves it (``ferry serve`` exits 2; ``ferry up`` does not
restart a child that exits 2)."""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
from collections.abc import Coroutine
from typing import Any

import grpc

from ferry.services.common.log import get_logger

log = get_logger(__name__)

USAGE_ERROR = 2  # the exit status of a process that cannot run as configured
NO_PORT_SHARING: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]


class PortInUse(Exception):
    def __init__(self, what: str, host: str, port: int, flag: str) -> None:
        super().__init__(
            f"{what} cannot listen on {host}:{port}: the port is in use (by another process, "
            f"perhaps another Ferry cluster) or not an address of this host; pick another with "
            f"{flag}"
        )


def check_free(host: str, port: int, what: str, flag: str) -> None:
    """PortInUse if ``port`` is taken now (0: any port, never taken): found before a service
    loads anything; the bind itself (add_port, listen_tcp) is what keeps it."""
    if port > 0:
        listen_tcp(host, port, what, flag).close()


def add_port(
    server: grpc.aio.Server,
    host: str,
    port: int,
    what: str,
    flag: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind ``server`` (made with NO_PORT_SHARING) to ``host:port``, with TLS when given
    ``credentials`` (tls.server_credentials); PortInUse when it cannot bind. Returns the bound
    port."""
    address = f"{host}:{port}"
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc: "Failed to bind to address ..."
        raise PortInUse(what, host, port, flag) from None


def listen_tcp(host: str, port: int, what: str, flag: str) -> socket.socket:
    """A listening TCP socket of this process alone (no SO_REUSEPORT); PortInUse when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not in use
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise PortInUse(what, host, port, flag) from None
        raise
    return sock


def run_serving(main: Coroutine[Any, Any, None], role: str) -> int:
    """Run a server's ``main`` to its end: 0, or USAGE_ERROR when a port it needs is taken
    (said on stderr, as `ferry serve ROLE: ...`)."""
    try:
        asyncio.run(main)
    except PortInUse as e:
        log.error("port_in_use", error=str(e))
        print(f"ferry serve {role}: {e}", file=sys.stderr)
        return USAGE_ERROR
    return 0
