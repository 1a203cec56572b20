"""Prometheus ``/metrics`` of a service, on an HTTP port of its own."""

from __future__ import annotations

import errno

from prometheus_client import start_http_server

from ferry.services.common.log import get_logger

log = get_logger(__name__)


def start_metrics_server(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the default registry; returns the bound port (-1: off, returns -1).

    A port that is taken by the time the service binds it (`ferry up` picks ports before its
    children start, and a DEP rank's group start-up opens many connections meanwhile) is not
    fatal: metrics go to any free port, which the service registers in Redis as usual.
    """
    if port < 0:
        return -1
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as e:
        if e.errno != errno.EADDRINUSE or port == 0:
            raise
        log.warning("metrics port taken; serving metrics on another", asked=port)
        server, _thread = start_http_server(0, addr=host)
    bound: int = server.server_port
    return bound
