from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from ferry.services.common.log import bind_request, configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """configure_logging's handlers hold the captured stderr: do not leave them to later
    tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_log_lines_are_json_with_service_worker_and_request_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("decode", "decode-3", "info")
    log = get_logger("test")
    with bind_request("req-9"):
        log.info("pulled", blocks=4)
    log.debug("hidden below the level")
    log.warning("outside")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [ln["event"] for ln in lines] == ["pulled", "outside"]
    first, second = lines
    assert first["service"] == "decode" and first["worker_id"] == "decode-3"
    assert first["request_id"] == "req-9" and first["blocks"] == 4 and first["level"] == "info"
    assert "request_id" not in second


def test_libraries_stdlib_logging_comes_out_as_the_same_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """uvicorn (the gateway) and asyncio log through the stdlib: their lines are JSON too."""
    configure_logging("gateway", "gateway-8000", "info")
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 7)
    logging.getLogger("asyncio").debug("hidden below the level")
    (line,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert line["event"] == "Started server process [7]" and line["logger"] == "uvicorn.error"
    assert line["service"] == "gateway" and line["level"] == "info" and "timestamp" in line
