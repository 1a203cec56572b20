"""Prometheus ``/metrics`` of a service, on an HTTP port of its own."""

from __future__ import annotations

import errno

from prometheus_client import start_http_server

from ferry.services.common.listeners import PortInUse


def start_metrics_server(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the default registry; returns the bound port (-1: off, returns -1). A taken port
    is PortInUse, as for every listener (listeners.py)."""
    if port < 0:
        return -1
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise PortInUse("the metrics server", host, port, "--metrics-port") from None
    bound: int = server.server_port
    return bound
