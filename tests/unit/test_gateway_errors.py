"""Every client mistake the gateway can see by itself is a 4xx in OpenAI's shape naming the
parameter, counted under a bounded route label: no 500, no ``{"detail": ...}``. The gateway runs
in this process with no scheduler behind it (nothing here should reach one)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from ferry.gateway import metrics
from ferry.gateway.app import create_app
from ferry.gateway.backend import Backend
from ferry.gateway.config import GatewayConfig
from ferry.gateway.errors import PARAMS, from_grpc
from ferry.gateway.grpc_api import start_grpc
from ferry.protos import ferry_pb2

JSON = {"content-type": "application/json"}
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    config = GatewayConfig(model="tiny", schedulers=("127.0.0.1:9",), scheduler_wait_s=0.1)
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        yield c


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 2**31),
        ("seed", 2**70),
        ("top_k", 2**40),
        ("min_tokens", -(2**40)),
        ("truncate_prompt_tokens", 2**40),
        ("stop_token_ids", [2**40]),
        ("prompt", [1, 2**40]),
        ("prompt", [[1], [-1]]),
        ("logit_bias", {str(2**40): 1.0}),
    ],
)
def test_integers_a_protobuf_field_cannot_hold_are_400(
    client: TestClient, field: str, value: object
) -> None:
    err = error_of(client.post("/v1/completions", json={**BODY, field: value}), 400)
    assert err["param"].split(".")[0] == field, err


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": ["\\udc00"]}', "stop.0"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        ("/tokenize", b'{"model": "tiny", "prompt": "\\udfff"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a", "top_p": Infinity}', "top_p"),
    ],
)
def test_text_that_is_not_unicode_and_numbers_that_are_not_finite_are_400(
    client: TestClient, path: str, raw: bytes, param: str
) -> None:
    err = error_of(client.post(path, content=raw, headers=JSON), 400)
    assert err["param"] == param, err


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', "could not be read as JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "could not be read as JSON"),
        (b"{not json", "not valid JSON"),
        (b"", "no body"),
        (b"[1, 2]", "object"),
    ],
    ids=["bad-utf8", "too-deep", "not-json", "empty", "not-an-object"],
)
def test_a_body_that_is_not_a_json_object_is_400(client: TestClient, raw: bytes, says: str) -> None:
    err = error_of(client.post("/v1/completions", content=raw, headers=JSON), 400)
    assert says in err["message"], err


def test_no_route_and_no_method_are_in_openai_shape(client: TestClient) -> None:
    assert error_of(client.get("/v1/nope"), 404)["type"] == "not_found_error"
    assert "GET" in error_of(client.get("/v1/completions"), 405)["message"]


def test_the_endpoint_label_is_the_route_not_the_path(client: TestClient) -> None:
    def count(endpoint: str, status: str) -> float:
        return float(metrics.REQUESTS.labels(endpoint, status)._value.get())

    before = count("unmatched", "404")
    for i in range(3):
        client.get(f"/v1/no-such-thing-{i}")
    assert count("unmatched", "404") == before + 3
    before = count("/v1/models/{name:path}", "404")
    client.get("/v1/models/other-model")
    assert count("/v1/models/{name:path}", "404") == before + 1


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options is for"),
        (
            {**CHAT, "messages": [{"role": "tool", "content": "42"}]},
            "tool message needs tool_call_id",
        ),
    ],
)
def test_what_openai_refuses_is_refused(
    client: TestClient, body: dict[str, Any], says: str
) -> None:
    assert says in error_of(client.post("/v1/chat/completions", json=body), 400)["message"]


def test_openai_fields_that_change_nothing_are_taken() -> None:
    """store, metadata, user, ...: not a 400 (the request goes on, to no scheduler here)."""
    config = GatewayConfig(model="tiny", schedulers=("127.0.0.1:9",), scheduler_wait_s=0.1)
    extra = {"store": True, "metadata": {"k": "v"}, "user": "u", "service_tier": "auto"}
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", BODY)):
            assert error_of(c.post(path, json={**body, **extra}), 503)["code"]


def test_an_empty_prompt_is_400_as_over_grpc(client: TestClient) -> None:
    err = error_of(client.post("/v1/completions", json={**BODY, "prompt": ""}), 400)
    assert err["param"] == "prompt"


def test_with_a_key_every_route_but_health_needs_it() -> None:
    config = GatewayConfig(
        model="tiny", schedulers=("127.0.0.1:9",), scheduler_wait_s=0.1, api_key="sesame"
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        for path, body in (
            ("/tokenize", {"model": "tiny", "prompt": "hi"}),
            ("/detokenize", {"model": "tiny", "tokens": [1]}),
        ):
            assert error_of(c.post(path, json=body), 401)["code"] == "invalid_api_key"
            keyed = c.post(path, json=body, headers={"Authorization": "Bearer sesame"})
            assert keyed.status_code == 200, keyed.text
        assert c.get("/metrics").status_code == 200  # open unless --metrics-auth
        assert c.get("/health").status_code == 503  # no scheduler: but no key asked
    locked = GatewayConfig(**{**config.__dict__, "metrics_auth": True})
    with TestClient(create_app(locked), raise_server_exceptions=False) as c:
        assert error_of(c.get("/metrics"), 401)["code"] == "invalid_api_key"
        assert c.get("/metrics", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_the_openapi_schema_documents_the_error_shape(client: TestClient) -> None:
    """Every route's 4xx and 5xx are ErrorBody (schemathesis checks answers against it), and
    no route claims FastAPI's 422, which the gateway never sends."""
    schema = client.get("/openapi.json").json()
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            responses = op["responses"]
            assert "422" not in responses, (method, path)
            for status in ("4XX", "5XX"):
                body = responses[status]["content"]["application/json"]["schema"]
                assert body == {"$ref": "#/components/schemas/ErrorBody"}, (method, path)


@pytest.mark.parametrize("method", ["Generate", "ListModels"])
def test_grpc_request_bytes_that_do_not_parse_are_invalid_argument(method: str) -> None:
    """Not UNKNOWN, grpc's answer when a request's deserializer raises (found by tests/fuzz);
    a request that parses still reaches its method."""

    async def calls() -> tuple[grpc.aio.AioRpcError, bytes]:
        config = GatewayConfig(model="tiny", schedulers=("127.0.0.1:9",), scheduler_wait_s=0.1)
        backend = Backend(config)
        server, port = await start_grpc(backend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                send = channel.unary_stream if method == "Generate" else channel.unary_unary
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    call = send(f"/ferry.v1.Ferry/{method}")(b"\x00", timeout=10)
                    _ = [r async for r in call] if method == "Generate" else await call
                models = await channel.unary_unary("/ferry.v1.Ferry/ListModels")(b"", timeout=10)
                return refused.value, models
        finally:
            await server.stop(None)
            await backend.close()

    refused, models = asyncio.run(calls())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert "is not a ferry.v1." in (refused.details() or ""), refused
    assert ferry_pb2.ListModelsReply.FromString(models).models[0].id == "tiny"


@pytest.mark.parametrize(
    ("details", "param"),
    [
        ("decode worker decode-0: temperature must be >= 0, got -1.0", "temperature"),
        ("prompt_logprobs must be in 0..20", "prompt_logprobs"),
        ("stop strings must not be empty", "stop"),
        ("min_tokens cannot be combined with a structured output", "min_tokens"),
        ("prompt is empty", "prompt"),
        ("no worker can serve it", None),
    ],
)
def test_a_refusal_names_the_sampling_field_it_starts_with(details: str, param: str | None) -> None:
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, details).param == param


def test_the_engines_sampling_fields_are_the_protos() -> None:
    """PARAMS comes from the proto; the engine's messages name its own fields: the same names."""
    from dataclasses import fields

    from ferry.services.common.sampling_params import SamplingParams

    assert {f.name for f in fields(SamplingParams)} == set(PARAMS)
