"""The Python SDK (FerryClient, AsyncFerryClient) against a real `ferry up` cluster, through the
gateway's public gRPC API."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from ferry.gateway.sdk import (
    AsyncFerryClient,
    FerryClient,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from ferry.infra.ports import free_port
from ferry.services.common.tokenizer import load_tokenizer
from tests.cluster import Cluster, ferry_up
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def cluster(redis: RedisServer) -> Iterator[Cluster]:
    with ferry_up(
        redis.url, "--num-kv-blocks", "256", "--worker-args", "--block-size 16", cluster="sdk"
    ) as c:
        yield c


def test_generate_streams_and_complete_agrees(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        assert [m.id for m in client.models()] == ["tiny"]
        chunks = list(client.generate("Hello there", max_tokens=12, temperature=0, ignore_eos=True))
        done = client.complete("Hello there", max_tokens=12, temperature=0, ignore_eos=True)
    assert len(chunks) >= 2 and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids and len(done.token_ids) == 12
    assert done.usage.prompt_tokens == len(load_tokenizer("tiny").encode("Hello there"))
    assert done.usage.completion_tokens == 12


def test_public_grpc_health_service(cluster: Cluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.grpc) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "ferry.v1.Ferry"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_token_ids_in_and_seeded_sampling(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        a = client.complete([256, 10, 20, 30], max_tokens=8, temperature=1.0, seed=7)
        b = client.complete([256, 10, 20, 30], max_tokens=8, temperature=1.0, seed=7)
    assert a.token_ids == b.token_ids and a.usage.prompt_tokens == 4


def test_logit_bias_steers_the_draws(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        forced = client.complete([256, 10], max_tokens=4, temperature=1.0, logit_bias={42: 100})
        (greedy,) = client.complete([256, 10], max_tokens=1, temperature=0).token_ids
        banned = client.complete([256, 10], max_tokens=1, temperature=0, logit_bias={greedy: -100})
    assert forced.token_ids == [42] * 4 and banned.token_ids != [greedy]


def test_structured_output_and_priority_through_the_sdk(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        out = client.complete(
            "Pick:",
            max_tokens=10,
            temperature=1.0,
            seed=2,
            priority=-1,
            structured_output={"choice": {"values": ["up", "down"]}},
        )
        with pytest.raises(InvalidRequestError, match=r"\(grammar\) does not compile"):
            client.complete("x", max_tokens=4, structured_output={"grammar": "root ::= "})
    assert out.text in ("up", "down") and out.finish_reason == "stop"


def test_prompt_logprobs_come_with_the_first_chunk(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        whole = client.complete([256, 10, 20, 30], max_tokens=3, prompt_logprobs=2)
        chunks = list(client.generate([256, 10, 20, 30], max_tokens=3, prompt_logprobs=2))
        with pytest.raises(InvalidRequestError, match=r"prompt_logprobs must be in 0\.\.20"):
            client.complete("x", max_tokens=4, prompt_logprobs=21)
    assert [next(iter(lp)) for lp in whole.prompt_logprobs] == [10, 20, 30]
    assert all(2 <= len(lp) <= 3 and max(lp.values()) <= 0 for lp in whole.prompt_logprobs)
    assert chunks[0].prompt_logprobs == whole.prompt_logprobs
    assert not any(c.prompt_logprobs for c in chunks[1:])


def test_errors_are_typed_with_the_server_message(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        with pytest.raises(InvalidRequestError, match="temperature must be >= 0") as info:
            client.complete("x", max_tokens=4, temperature=-2.0)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(NotFoundError, match="does not exist"):
            client.complete("x", model="gpt-9", max_tokens=4)
        with pytest.raises(TypeError, match="unknown sampling parameter"):
            client.complete("x", max_tokenz=4)


def test_grpc_calls_are_counted_like_rest_requests(cluster: Cluster) -> None:
    def count(status: str) -> float:
        endpoint = 'ferry_gateway_requests_total{endpoint="/ferry.v1.Ferry/Generate"'
        with urllib.request.urlopen(cluster.gateway + "/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        return sum(
            float(ln.split()[-1])
            for ln in lines
            if ln.startswith(endpoint) and f'status="{status}"' in ln
        )

    ok, bad = count("200"), count("400")
    with FerryClient(cluster.grpc) as client:
        client.complete("x", max_tokens=2)
        with pytest.raises(InvalidRequestError):
            client.complete("x", max_tokens=4, temperature=-2.0)
    assert (count("200"), count("400")) == (ok + 1, bad + 1)


def test_unavailable_is_retried_then_raised() -> None:
    with FerryClient(
        f"127.0.0.1:{free_port()}", max_retries=2, retry_backoff=0.1, timeout=5
    ) as client:
        started = time.monotonic()
        with pytest.raises(UnavailableError):
            client.complete("x", max_tokens=2)
        assert time.monotonic() - started >= 0.3  # backoff 0.1 + 0.2: it did retry twice


def test_breaking_out_of_a_stream_frees_the_blocks(cluster: Cluster) -> None:
    with FerryClient(cluster.grpc) as client:
        for i, _ in enumerate(client.generate("long", max_tokens=800, ignore_eos=True)):
            if i == 5:
                break
    cluster.wait_for("blocks free after break", cluster.all_blocks_free, 10)


def test_async_client_streams_concurrently_and_cancels(cluster: Cluster) -> None:
    async def main() -> list[str]:
        async with AsyncFerryClient(cluster.grpc) as client:
            assert [m.id for m in await client.models()] == ["tiny"]
            done = await asyncio.gather(
                *(
                    client.complete(f"prompt {i}", max_tokens=6, temperature=0, ignore_eos=True)
                    for i in range(4)
                )
            )
            stream = client.generate("long", max_tokens=800, ignore_eos=True)
            async for _ in stream:
                break
            await stream.aclose()
            return [d.finish_reason for d in done]

    assert asyncio.run(main()) == ["length"] * 4
    cluster.wait_for("blocks free after async break", cluster.all_blocks_free, 10)
