"""OpenTelemetry traces of a request across the services.

One tracer per process (``configure``, from ``--otlp-endpoint`` / ``--trace-file``): its
resource's ``service.name`` is the role (``SERVICE_NAMES``), ``service.instance.id`` the worker
id. Spans leave in batches (BatchSpanProcessor) over OTLP/gRPC, and/or as JSON lines to a file
(``trace_file.py``: what the tests and ``python -m ferry.infra.trace_view`` read); ``shutdown``
flushes them when the process stops. With neither flag tracing is off: ``span`` is one shared
no-op context manager, ``outgoing`` and ``incoming`` return None, the SDK is not imported, and
no span object exists.

Spans are never made "current": a span names its parent (a span, or the context that came
with a call), so a span opened inside an async generator is safe whichever task closes it.
The context crosses every internal gRPC call as W3C ``traceparent`` metadata (``outgoing`` at
the call, ``incoming`` in the servicer); the gateway takes a client's ``traceparent`` header.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    import grpc
    from opentelemetry.sdk.trace import TracerProvider

# the role of `ferry serve ROLE` -> the service.name its spans carry
SERVICE_NAMES = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "prefill": "prefill-worker",
    "decode": "decode-worker",
    "aggregated": "aggregated",
    "eplb": "eplb-controller",
}
FILE_EXPORT_DELAY_MS = 500  # a span reaches --trace-file within about this long of its end
STEP_EVENT_EVERY = 256  # a decode span gets an event every this many engine steps

Parent = Span | Context | None
_OFF: contextlib.nullcontext[Span] = contextlib.nullcontext(trace.INVALID_SPAN)
_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing is off
_provider: TracerProvider | None = None


def configure(role: str, instance: str, otlp_endpoint: str = "", trace_file: str = "") -> None:
    """Trace this process's requests to ``otlp_endpoint`` (HOST:PORT of an OTLP/gRPC collector)
    and/or ``trace_file`` (a path; one ending in "/" or naming a directory: INSTANCE.jsonl in
    it). Neither: tracing stays off."""
    global _tracer, _provider
    shutdown()
    if not (otlp_endpoint or trace_file):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = SERVICE_NAMES.get(role, role)
    resource = Resource.create({"service.name": service, "service.instance.id": instance})
    _provider = TracerProvider(resource=resource)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        secure = otlp_endpoint.startswith("https://")
        otlp = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=not secure)
        _provider.add_span_processor(BatchSpanProcessor(otlp))
    if trace_file:
        from ferry.services.common.trace_file import JsonLinesExporter

        path = file_for(trace_file, instance)
        processor = BatchSpanProcessor(
            JsonLinesExporter(path), schedule_delay_millis=FILE_EXPORT_DELAY_MS
        )
        _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer("ferry")


def file_for(trace_file: str, instance: str) -> Path:
    """The file this process writes: ``trace_file``, or ``trace_file/INSTANCE.jsonl`` when it
    ends in "/" or is a directory (`ferry up --trace-file DIR` gives each child its own)."""
    path = Path(trace_file)
    if trace_file.endswith("/") or path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        return path / f"{instance}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def shutdown() -> None:
    """Export what is buffered and stop tracing (a stopping process calls it last)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()  # flushes every processor
    _tracer, _provider = None, None


def enabled() -> bool:
    return _tracer is not None


def span(
    name: str, parent: Parent = None, **attributes: Any
) -> contextlib.AbstractContextManager[Span]:
    """A span from entry to exit, the child of ``parent`` (None: a new trace). An exception
    that leaves it sets its status to ERROR; GeneratorExit and CancelledError do not (a stream
    closed by its reader, a call the client cancelled: the call site says what happened)."""
    if _tracer is None:
        return _OFF
    return _span(_tracer, name, parent, attributes)


@contextlib.contextmanager
def _span(
    tracer: trace.Tracer, name: str, parent: Parent, attributes: dict[str, Any]
) -> Iterator[Span]:
    s = tracer.start_span(name, context=_context(parent), attributes=attributes)
    try:
        yield s
    except Exception as e:
        s.set_status(Status(StatusCode.ERROR, str(e) or type(e).__name__))
        raise
    finally:
        s.end()


def start(name: str, parent: Parent = None, **attributes: Any) -> Span:
    """A span the caller ends (``span.end()``) where a ``with`` block would not fit, e.g. in
    the ``finally`` of a stream that already has one. A no-op span when tracing is off."""
    if _tracer is None:
        return trace.INVALID_SPAN
    return _tracer.start_span(name, context=_context(parent), attributes=attributes)


def record(name: str, parent: Parent, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A span whose times are known after the fact (an engine step, a queue wait)."""
    if _tracer is None:
        return
    s = _tracer.start_span(
        name, context=_context(parent), start_time=start_ns, attributes=attributes
    )
    s.end(end_time=end_ns)


def _context(parent: Parent) -> Context:
    if parent is None:
        return Context()  # a root: whatever else this task may have open is not its parent
    if isinstance(parent, Context):
        return parent
    return trace.set_span_in_context(parent, Context())


def outgoing(parent: Span) -> list[tuple[str, str]] | None:
    """The metadata of a gRPC call made under ``parent`` (``traceparent``); None when off."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(parent, Context()))
    return list(carrier.items())


def incoming(context: grpc.aio.ServicerContext) -> Context | None:
    """The caller's span, from a gRPC call's metadata; None when off or none came."""
    if _tracer is None:
        return None
    return from_headers(
        {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
    )


def from_headers(headers: Mapping[str, str]) -> Context | None:
    """The caller's span from W3C ``traceparent`` (and ``tracestate``) headers; None when off
    or none came."""
    if _tracer is None or "traceparent" not in headers:
        return None
    return _PROPAGATOR.extract(headers, context=Context())


class Steps:
    """The engine steps a request joined, coalesced into its span: a count, the tokens, when
    the first and last arrived, and an event every STEP_EVENT_EVERY steps. Not a span per
    token: a 1,000-token decode is one span with a few events."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self.count = 0
        self.tokens = 0
        self.last_ns = 0

    @classmethod
    def of(cls, span: Span) -> Steps | None:
        """None when ``span`` records nothing (tracing off): the caller skips the bookkeeping."""
        return cls(span) if span.is_recording() else None

    def add(self, steps: int, tokens: int) -> None:
        now = time.time_ns()
        if not self.count:
            self.span.add_event("first_step", timestamp=now)
        before, self.count = self.count, self.count + steps
        self.tokens += tokens
        self.last_ns = now
        if before // STEP_EVENT_EVERY != self.count // STEP_EVENT_EVERY:
            self.span.add_event(
                "steps", {"steps": self.count, "tokens": self.tokens}, timestamp=now
            )

    def close(self) -> None:
        self.span.set_attributes({"steps": self.count, "tokens": self.tokens})
        if self.count:
            self.span.add_event("last_step", timestamp=self.last_ns)
