"""The spans of a request's trace that a worker times from its engine's outputs."""

from __future__ import annotations

import time

from opentelemetry.trace import Span

from ferry.services.common import tracing
from ferry.services.engine.request import RequestOutput


def prefill_spans(parent: Span, submitted_ns: int, first: RequestOutput) -> None:
    """``queue`` (from its submission until the engine first admitted it) and ``forward``
    (from then until its first token reached the event loop: every chunk of its prompt), as
    children of ``parent``, from the request's first output."""
    if not parent.is_recording() or not first.admitted_ns:
        return
    cached = first.num_cached_tokens
    tracing.record("queue", parent, submitted_ns, first.admitted_ns)
    tracing.record(
        "forward",
        parent,
        first.admitted_ns,
        time.time_ns(),
        tokens=len(first.prompt_token_ids) - cached,
        cached_tokens=cached,
    )
