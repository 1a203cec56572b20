"""structlog JSON logs: one line per event on stderr, with service, worker_id and (inside
:func:`bind_request`) request_id on every line; the stdlib logging of libraries (uvicorn,
asyncio) goes through the same renderer."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog


def configure_logging(
    service: str, worker_id: str = "", level: str = "info", json: bool = True
) -> None:
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    fields: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*fields, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    # the libraries' stdlib logging (uvicorn, asyncio, grpc's Python side) in the same lines
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*fields, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, worker_id=worker_id)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()


@contextmanager
def bind_request(request_id: str) -> Iterator[None]:
    """Add ``request_id`` to every log line of this task inside the block."""
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield
