"""Traces of real requests through `ferry up --trace-file DIR --otlp-endpoint ...` (1 prefill,
2 decode, UCX, --migration-limit 1, --restart never): every process writes its spans to
DIR/NAME.jsonl, and one request's spans, read from all of them, form one tree across gateway →
scheduler → prefill worker (queue, forward) → KV transfer → decode worker; a request whose
decode worker is killed mid-stream shows both of its attempts in that one trace. The same spans
reach an OTLP/gRPC receiver (opentelemetry-proto's TraceService, what a collector serves)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ferry.infra import trace_view
from ferry.infra.ports import free_port
from ferry.protos import ferry_pb2, ferry_pb2_grpc
from tests.cluster import Cluster, ferry_up, greedy
from tests.waits import wait_until

Span = dict[str, Any]
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
PROMPT = [(5 * j) % 250 + 1 for j in range(40)]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver, as a collector (Jaeger, the OpenTelemetry collector) serves
    it on 4317: keeps each span it is sent as (service, instance, trace id, span id, parent)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, str, str]] = []
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            res = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service, instance = res["service.name"], res["service.instance.id"]
            got = [
                (service, instance, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                for scope in resource_spans.scope_spans
                for s in scope.spans
            ]
            with self.lock:
                self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> set[tuple[str, str, str, str, str]]:
        with self.lock:
            return {s for s in self.spans if s[2] == trace_id}


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    received = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield received, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, collector: tuple[Collector, str]
) -> Iterator[tuple[Cluster, Path]]:
    traces = tmp_path_factory.mktemp("traces")
    with ferry_up(
        "",
        *("--prefill", "1", "--decode", "2", "--migration-limit", "1"),
        *("--restart", "never", "--trace-file", str(traces)),
        *("--otlp-endpoint", collector[1]),
        *("--worker-args", "--block-size 16 --transfer-timeout 5"),
        cluster="traced",
    ) as c:
        yield c, traces


def complete_as_client(cluster: Cluster, trace_id: str, tokens: int) -> None:
    """A REST completion of ``tokens`` greedy tokens whose traceparent names the client's span
    CLIENT_SPAN in trace ``trace_id``."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    req = urllib.request.Request(
        f"{cluster.gateway}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == tokens


def wait_for_trace(
    traces: Path, ok: Callable[[list[Span]], bool], timeout: float = 20
) -> list[Span]:
    """Read the files until a trace satisfies ``ok`` (its spans are exported in batches,
    each process's within about a second of their end)."""

    def found() -> dict[str, list[Span]]:
        return trace_view.traces(trace_view.read_spans([traces]))

    def names() -> str:
        return str(
            {t: sorted(f"{s['service']}/{s['name']}" for s in ss) for t, ss in found().items()}
        )

    def match() -> list[Span] | None:
        return next((spans for spans in found().values() if ok(spans)), None)

    return wait_until("such a trace", match, timeout, 0.1, explain=names)


def one(spans: list[Span], service: str, name: str, **attrs: object) -> Span:
    (span,) = matching(spans, service, name, **attrs)
    return span


def matching(spans: list[Span], service: str, name: str, **attrs: object) -> list[Span]:
    return [
        s
        for s in spans
        if (s["service"], s["name"]) == (service, name)
        and all(s["attributes"].get(k) == v for k, v in attrs.items())
    ]


def test_a_request_is_one_trace_from_the_gateway_to_the_decode_worker(
    traced: tuple[Cluster, Path],
) -> None:
    """A REST request that carries the client's traceparent: the gateway's span is its child,
    and every service's spans hang under the call that reached it."""
    cluster, traces = traced
    complete_as_client(cluster, CLIENT_TRACE, 8)

    def whole(spans: list[Span]) -> bool:
        names = {(s["service"], s["name"]) for s in spans}
        return (
            spans[0]["trace_id"] == CLIENT_TRACE
            and {
                ("gateway", "request"),
                ("scheduler", "generate"),
                ("prefill-worker", "forward"),
                ("decode-worker", "decode"),
            }
            <= names
        )

    spans = wait_for_trace(traces, whole)
    request = one(spans, "gateway", "request")
    assert request["parent_span_id"] == CLIENT_SPAN
    assert (
        request["attributes"] | {"api": "rest", "status": 200, "output_tokens": 8}
        == request["attributes"]
    )
    stream = one(spans, "gateway", "stream")
    generate = one(spans, "scheduler", "generate")
    first = one(spans, "scheduler", "attempt", stage="prefill")
    then = one(spans, "scheduler", "attempt", stage="decode")
    prefill = one(spans, "prefill-worker", "prefill")
    queue = one(spans, "prefill-worker", "queue")
    forward = one(spans, "prefill-worker", "forward")
    decode = one(spans, "decode-worker", "decode")
    kv = one(spans, "decode-worker", "kv_transfer")
    for child, parent in [
        (stream, request),
        (generate, stream),
        (first, generate),
        (then, generate),
        (prefill, first),
        (queue, prefill),
        (forward, prefill),
        (decode, then),
        (kv, decode),
    ]:
        assert child["parent_span_id"] == parent["span_id"], (child["name"], parent["name"])
        assert parent["start_ns"] <= child["start_ns"] <= child["end_ns"]
    assert queue["end_ns"] <= forward["start_ns"]
    assert forward["attributes"]["tokens"] + forward["attributes"]["cached_tokens"] == len(PROMPT)
    assert {first["attributes"]["outcome"], then["attributes"]["outcome"]} == {"ok"}
    assert kv["attributes"]["transport"] == "ucx"
    assert kv["attributes"]["blocks"] == len(PROMPT) // 16 + 1 and kv["attributes"]["bytes"] > 0
    assert kv["end_ns"] <= decode["end_ns"]
    # the first token came from the prefill; the decode worker's 7 steps are one span
    assert (decode["attributes"]["steps"], decode["attributes"]["tokens"]) == (7, 7)
    assert [e["name"] for e in decode["events"]] == ["first_step", "last_step"]
    assert generate["attributes"]["outcome"] == "ok"


def test_the_spans_reach_an_otlp_collector_as_they_reach_the_files(
    traced: tuple[Cluster, Path], collector: tuple[Collector, str]
) -> None:
    """--otlp-endpoint: every process sends the same spans over OTLP/gRPC that it writes to its
    file (each exporter batches on its own; OTLP's waits up to 5 s)."""
    cluster, traces = traced
    received, _ = collector
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    complete_as_client(cluster, trace_id, 4)
    spans = wait_for_trace(
        traces,
        lambda ss: (
            ss[0]["trace_id"] == trace_id
            and {"gateway", "scheduler", "prefill-worker", "decode-worker"}
            <= {s["service"] for s in ss}
        ),
    )
    in_files = {
        (s["service"], s["instance"], s["trace_id"], s["span_id"], s["parent_span_id"])
        for s in spans
    }
    wait_until(
        "the file's spans at the collector",
        lambda: in_files <= received.trace(trace_id),
        30,
        0.1,
        explain=lambda: f"missing {sorted(in_files - received.trace(trace_id))}",
    )


def test_a_request_moved_off_a_killed_decode_worker_shows_both_attempts_in_one_trace(
    traced: tuple[Cluster, Path],
) -> None:
    """kill -9 of the decode worker streaming a request (--migration-limit 1): the scheduler's
    span holds the failed decode attempt and the move's prefill and decode attempts on the
    other worker, each with the worker's own spans under it."""
    cluster, traces = traced
    n = 900

    async def main() -> tuple[int, str]:
        async with grpc.aio.insecure_channel(cluster.grpc) as channel:
            call = ferry_pb2_grpc.FerryStub(channel).Generate(
                ferry_pb2.TextGenerateRequest(
                    request_id="moved",
                    prompt_token_ids=PROMPT,
                    sampling_params=greedy(n, ignore_eos=True),
                ),
                timeout=60,
            )
            sent_at, tokens, killed = time.time(), 0, ""
            async for chunk in call:
                tokens += len(chunk.token_ids)
                if not killed and tokens >= 20:
                    killed = await asyncio.to_thread(cluster.streaming_decode_worker, sent_at)
                    cluster.signal(killed, signal.SIGKILL)
            return tokens, killed

    tokens, killed = asyncio.run(asyncio.wait_for(main(), 90))
    assert tokens == n

    def moved(spans: list[Span]) -> bool:
        return all(
            matching(spans, service, name, request_id=rid)
            for service, name, rid in [
                ("gateway", "stream", "moved"),
                ("scheduler", "generate", "moved"),
                ("prefill-worker", "prefill", "moved.m1"),
                ("decode-worker", "decode", "moved.m1"),
            ]
        )

    spans = wait_for_trace(traces, moved)
    print(trace_view.waterfall(spans))  # docs/operating.md's example comes from this
    generate = one(spans, "scheduler", "generate", request_id="moved")
    attempts = sorted(matching(spans, "scheduler", "attempt"), key=lambda s: s["start_ns"])
    summary = [
        (a["attributes"]["stage"], a["attributes"]["migration"], a["attributes"]["outcome"])
        for a in attempts
    ]
    assert summary == [
        ("prefill", 0, "ok"),
        ("decode", 0, "UNAVAILABLE"),
        ("prefill", 1, "ok"),
        ("decode", 1, "ok"),
    ]
    assert all(a["parent_span_id"] == generate["span_id"] for a in attempts)
    assert attempts[1]["attributes"]["worker"] == killed != attempts[3]["attributes"]["worker"]
    assert [e["name"] for e in generate["events"]] == ["migrate"]
    assert generate["attributes"]["migrations"] == 1
    prefills = {
        s["attributes"]["request_id"]: s for s in matching(spans, "prefill-worker", "prefill")
    }
    assert prefills["moved"]["parent_span_id"] == attempts[0]["span_id"]
    assert prefills["moved.m1"]["parent_span_id"] == attempts[2]["span_id"]
    decode = one(spans, "decode-worker", "decode", request_id="moved.m1")
    assert decode["parent_span_id"] == attempts[3]["span_id"]
    assert decode["instance"] != killed
    # the killed worker's decode span died with it; its KV transfer's span may have been
    # exported before, and then stands at the top level of the trace
    pulls = matching(spans, "decode-worker", "kv_transfer")
    assert [s["parent_span_id"] == decode["span_id"] for s in pulls].count(True) == 1
    assert one(spans, "gateway", "request")["attributes"]["output_tokens"] == n


def test_a_sigtermed_gateway_exports_its_spans_and_stops_gracefully(tmp_path: Path) -> None:
    """SIGTERM right after a request: `ferry serve` flushes the spans as it stops. (uvicorn
    raises the signal again once it has stopped; under the default handler the process died
    there, before the gRPC API's grace and the flush.)"""
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "ferry.infra.cli", "serve", "gateway"]
    cmd += ["--port", str(port), "--grpc-port", "0", "--scheduler", f"127.0.0.1:{free_port()}"]
    cmd += ["--scheduler-wait", "0.2", "--trace-file", f"{tmp_path}/"]
    gateway = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )

        def refused() -> bool:  # 503 once it serves: no scheduler answers
            assert gateway.poll() is None, "the gateway exited"
            try:
                urllib.request.urlopen(req, timeout=5)
            except urllib.error.HTTPError as e:
                assert e.code == 503
                return True
            except urllib.error.URLError:
                return False
            raise AssertionError("served without a scheduler")

        wait_until("the gateway serving", refused, 30, 0.1)
        gateway.send_signal(signal.SIGTERM)
        _, err = gateway.communicate(timeout=30)
    finally:
        if gateway.poll() is None:
            gateway.kill()
    assert gateway.returncode == 0, err[-2000:]
    assert '"stopped"' in err
    (request,) = [s for s in trace_view.read_spans([tmp_path]) if s["name"] == "request"]
    assert request["attributes"]["status"] == 503 and request["service"] == "gateway"
