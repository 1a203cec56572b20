from __future__ import annotations

import json

import pytest
import structlog

from ferry.services.common.log import bind_request, configure_logging, get_logger


def test_log_lines_are_json_with_service_worker_and_request_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("decode", "decode-3", "info")
    try:
        log = get_logger("test")
        with bind_request("req-9"):
            log.info("pulled", blocks=4)
        log.debug("hidden below the level")
        log.warning("outside")
    finally:  # the logger holds the captured stderr: do not leave it to later tests
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [ln["event"] for ln in lines] == ["pulled", "outside"]
    first, second = lines
    assert first["service"] == "decode" and first["worker_id"] == "decode-3"
    assert first["request_id"] == "req-9" and first["blocks"] == 4 and first["level"] == "info"
    assert "request_id" not in second
