"""Tracing (services/common/tracing.py): off by default at no cost, the JSON-lines file, W3C
traceparent over a real gRPC call and from an HTTP header, export to a real OTLP/gRPC receiver,
`ferry up`'s flags for its children, and the waterfall of trace_view."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ferry.infra import trace_view
from ferry.services.common import tracing

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def tracing_off_after() -> Iterator[None]:
    yield
    tracing.shutdown()


def spans_in(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_by_default_every_span_is_one_shared_no_op() -> None:
    """No flag: nothing records, no span object is made per call, no metadata goes out."""
    assert not tracing.enabled()
    first, second = tracing.span("a", request_id="r"), tracing.span("b")
    assert first is second
    with first as span:
        assert not span.is_recording()
        assert tracing.outgoing(span) is None
        assert tracing.Steps.of(span) is None
    assert tracing.start("attempt") is tracing.start("attempt")
    assert tracing.from_headers({"traceparent": TRACEPARENT}) is None


def test_the_file_holds_one_span_a_line_with_parents_events_and_service(tmp_path: Path) -> None:
    tracing.configure("decode", "decode-0", trace_file=f"{tmp_path}/traces/")
    path = tmp_path / "traces" / "decode-0.jsonl"
    with tracing.span("decode", request_id="r1", worker="decode-0") as root:
        now = time.time_ns()
        tracing.record("queue", root, now - 2_000_000, now - 1_000_000)
        steps = tracing.Steps.of(root)
        assert steps is not None
        for _ in range(tracing.STEP_EVENT_EVERY + 1):
            steps.add(1, 1)
        steps.close()
        with pytest.raises(ValueError), tracing.span("kv_transfer", root, blocks=3):
            raise ValueError("peer went away")
    tracing.shutdown()  # flushes
    spans = {s["name"]: s for s in spans_in(path)}
    assert spans.keys() == {"decode", "queue", "kv_transfer"}
    decode = spans["decode"]
    assert decode["service"] == "decode-worker" and decode["instance"] == "decode-0"
    assert decode["parent_span_id"] == ""
    assert len(str(decode["trace_id"])) == 32 and len(str(decode["span_id"])) == 16
    for child in ("queue", "kv_transfer"):
        assert spans[child]["parent_span_id"] == decode["span_id"]
        assert spans[child]["trace_id"] == decode["trace_id"]
    steps_ = tracing.STEP_EVENT_EVERY + 1
    assert decode["attributes"] == {
        "request_id": "r1",
        "worker": "decode-0",
        "steps": steps_,
        "tokens": steps_,
    }
    assert [e["name"] for e in decode["events"]] == ["first_step", "steps", "last_step"]  # type: ignore[index]
    assert spans["kv_transfer"]["status"] == {"code": "ERROR", "description": "peer went away"}
    assert spans["queue"]["end_ns"] - spans["queue"]["start_ns"] == 1_000_000  # type: ignore[operator]


def test_traceparent_crosses_a_real_grpc_call_and_comes_from_an_http_header(
    tmp_path: Path,
) -> None:
    """The client's span is the parent of the server's: outgoing() at the call, incoming() in
    the handler; a REST client's traceparent header is the parent of the gateway's span."""
    path = tmp_path / "t.jsonl"
    tracing.configure("scheduler", "s", trace_file=str(path))

    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        with tracing.span("server", tracing.incoming(context)):
            return request

    async def main() -> None:
        server = grpc.aio.server()
        method = grpc.unary_unary_rpc_method_handler(handle)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Echo", {"Call": method}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/test.Echo/Call")
                with tracing.span("client") as span:
                    assert await call(b"x", metadata=tracing.outgoing(span)) == b"x"
        finally:
            await server.stop(None)

    asyncio.run(main())
    with tracing.span("request", tracing.from_headers({"traceparent": TRACEPARENT})):
        pass
    tracing.shutdown()
    spans = {s["name"]: s for s in spans_in(path)}
    assert spans["server"]["parent_span_id"] == spans["client"]["span_id"]
    assert spans["server"]["trace_id"] == spans["client"]["trace_id"]
    trace_id, parent = TRACEPARENT.split("-")[1:3]
    assert (spans["request"]["trace_id"], spans["request"]["parent_span_id"]) == (trace_id, parent)


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.received: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.arrived = threading.Event()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.append(request)
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_spans_go_to_an_otlp_grpc_collector() -> None:
    """--otlp-endpoint HOST:PORT: the spans reach a real OTLP/gRPC receiver by shutdown, with
    the process's service.name."""
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracing.configure("prefill", "prefill-0", otlp_endpoint=f"127.0.0.1:{port}")
        with tracing.span("prefill", prompt_tokens=7):
            pass
        tracing.shutdown()
        assert collector.arrived.wait(10)
    finally:
        server.stop(None)
    (rs,) = collector.received[0].resource_spans
    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
    assert resource["service.name"] == "prefill-worker"
    assert resource["service.instance.id"] == "prefill-0"
    (span,) = rs.scope_spans[0].spans
    assert span.name == "prefill"


def test_ferry_up_gives_every_child_the_collector_and_a_file_in_the_directory(
    tmp_path: Path,
) -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    args = build_parser().parse_args(
        ["up", "--trace-file", str(tmp_path), "--otlp-endpoint", "127.0.0.1:4317"]
    )
    for role, flags in cluster_spec(args).serve_args.items():
        given = build_parser().parse_args(["serve", role, *flags])
        assert given.trace_file == f"{tmp_path}/", role
        assert given.otlp_endpoint == "127.0.0.1:4317", role
    assert tracing.file_for(f"{tmp_path}/", "decode-1") == tmp_path / "decode-1.jsonl"


def _span(name: str, sid: str, parent: str, start: int, end: int, **attrs: object) -> str:
    return json.dumps(
        {
            "trace_id": "t" * 32,
            "span_id": sid,
            "parent_span_id": parent,
            "name": name,
            "service": name.split(".")[0],
            "instance": "",
            "start_ns": start * 1_000_000,
            "end_ns": end * 1_000_000,
            "attributes": attrs,
            "events": [],
            "status": {"code": "UNSET", "description": None},
        }
    )


def test_the_waterfall_nests_children_under_parents_across_files(tmp_path: Path) -> None:
    """Spans of one trace from several processes' files, each under its parent in start
    order; one whose parent is in no file (its process was killed) stands at the top level;
    a moved part's request id finds the trace."""
    (tmp_path / "a.jsonl").write_text(
        _span("gateway", "1", "", 0, 100, request_id="r")
        + "\n"
        + _span("gateway.late", "4", "1", 50, 60)
        + "\n"
    )
    (tmp_path / "b.jsonl").write_text(
        _span("scheduler", "2", "1", 10, 90, request_id="r.m1")
        + "\n"
        + _span("decode", "3", "gone", 20, 30)
        + "\n{cut short"
    )
    spans = trace_view.read_spans([tmp_path])
    assert len(spans) == 4
    found = trace_view.find(spans, request_id="r")
    rows = trace_view.waterfall(found).splitlines()[2:]
    names = [row.split()[1] for row in rows]
    assert names == ["gateway", "scheduler", "gateway.late", "decode"]
    span_column = [row[17:] for row in rows]  # after the service's
    depths = [len(col) - len(col.lstrip()) for col in span_column]
    assert depths == [0, 2, 2, 0]
    assert trace_view.find(spans, request_id="other") == []
    assert trace_view.main([str(tmp_path), "--trace-id", "t" * 32]) == 0
