"""``--trace-file``: finished spans as JSON lines, one span a line, appended (a restarted
process goes on in its file). The tests and ``python -m ferry.infra.trace_view`` read it.

A line: ``trace_id`` and ``span_id`` (hex, as W3C traceparent writes them), ``parent_span_id``
("" for a root), ``name``, ``service`` and ``instance`` (the resource's service.name and
service.instance.id), ``start_ns`` / ``end_ns`` (Unix ns), ``attributes``, ``events``
(``name``, ``time_ns``, ``attributes``) and ``status`` (``code``: UNSET, OK or ERROR;
``description``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx, res = span.context, span.resource.attributes
    assert ctx is not None
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else "",
        "name": span.name,
        "service": res.get("service.name", ""),
        "instance": res.get("service.instance.id", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "status": {"code": span.status.status_code.name, "description": span.status.description},
    }


class JsonLinesExporter(SpanExporter):
    """Each batch in one write, flushed: a reader sees whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
