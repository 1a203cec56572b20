"""Prometheus ``/metrics`` of a service, on an HTTP port of its own."""

from __future__ import annotations

from prometheus_client import start_http_server


def start_metrics_server(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the default registry; returns the bound port (-1: off, returns -1)."""
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host)
    bound: int = server.server_port
    return bound
