"""A service's /metrics port: the one asked for, or another when it was taken meanwhile."""

from __future__ import annotations

import socket
import urllib.request

from ferry.services.common.metrics_http import start_metrics_server


def test_a_taken_metrics_port_moves_to_a_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        asked = taken.getsockname()[1]
        bound = start_metrics_server(asked)
        assert bound not in (asked, -1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=5).read()
        assert b"python_info" in body
    assert start_metrics_server(-1) == -1
