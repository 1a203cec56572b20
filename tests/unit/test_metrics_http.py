"""A service's /metrics port: the one asked for; a taken one is a usage error."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from ferry.services.common.listeners import PortInUse
from ferry.services.common.metrics_http import start_metrics_server


def test_a_metrics_port_serves_and_a_taken_one_is_refused() -> None:
    bound = start_metrics_server(0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=5).read()
    assert b"python_info" in body
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        asked = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"127.0.0.1:{asked}.*--metrics-port"):
            start_metrics_server(asked)
    assert start_metrics_server(-1) == -1
