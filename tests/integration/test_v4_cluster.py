"""DeepSeek-V4 through a disaggregated cluster: `ferry up --model v4-tiny` with 1 prefill and
2 decode workers over UCX. The prefill worker hands each request's blocks and its prompt-end
state (the window, the compressors' open rows, packed into blocks) to a decode worker, which
continues from them: greedy outputs through the REST API and the scheduler equal the in-process
engine's, prompts of every length modulo the compression rates (4 and 16); a repeated prompt
hits the prefill worker's snapshot; a V3 handle is refused; a request whose decode worker is
killed moves on. After each test every KV block and state slot is free on every worker."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from ferry.services.common.convert import sampling_params_to_pb
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.kv_transfer.handle import LayoutFingerprint
from tests.cluster import (
    Cluster,
    completion_text,
    ferry_up,
    generate,
    generate_twice,
    greedy,
    kill_its_decode_worker,
    refused_handle,
)

pytestmark = pytest.mark.slow  # ~4 min: `make test-slow`

# lengths 9, 46, 83, 120: every remainder modulo the CSA rate (4), none a multiple of 16
PROMPTS = [[(11 * i + 5 * j) % 250 + 1 for j in range(9 + 37 * i)] for i in range(4)]
TOKENS = 12
MIGRATING = '"event": "migrating"'


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with ferry_up(
        "",
        "--model",
        "v4-tiny",
        "--prefill",
        "1",
        "--decode",
        "2",
        "--kv-transport",
        "ucx",
        "--migration-limit",
        "1",
        "--worker-args",
        "--verify-checksum --transfer-timeout 5",
        cluster="v4",
    ) as c:
        yield c


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="v4-tiny"))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_greedy_outputs_through_p_d_equal_the_in_process_engine(
    cluster: Cluster, engine: Engine
) -> None:
    """One at a time through the REST API (its text), then all at once through the scheduler
    (their token ids): the decode workers continue from the transferred state exactly."""
    want = [engine.generate([p], _greedy(TOKENS))[0] for p in PROMPTS]
    texts = [completion_text(cluster, "v4-tiny", p, TOKENS) for p in PROMPTS]
    assert texts == [w.text for w in want]

    async def together() -> list[list[int]]:
        rs = await asyncio.gather(
            *(generate(cluster.scheduler, p, greedy(TOKENS, ignore_eos=True)) for p in PROMPTS)
        )
        assert all(r.code is None for r in rs), [r.details for r in rs]
        return [r.token_ids for r in rs]

    assert asyncio.run(together()) == [w.token_ids for w in want]
    moved = sum(cluster.metric(d, "ferry_kv_transfer_bytes_total") for d in _decoders(cluster))
    assert moved > 0  # the state came over the transport, with the blocks
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)


def test_a_repeated_prompt_hits_the_prefill_workers_snapshot(
    cluster: Cluster, engine: Engine
) -> None:
    """The second time, the prefill worker continues from the state it snapshotted at the
    prompt's last block boundary (64 tokens of 120) and hands that on."""
    prompt = PROMPTS[3]
    (want,) = engine.generate([prompt], _greedy(TOKENS))
    (first, _), (again, cached) = generate_twice(cluster, prompt, TOKENS)
    assert first == again == want.token_ids
    assert cached == 64
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)


def test_a_decode_worker_refuses_a_deepseek_v3_handle(cluster: Cluster) -> None:
    """A handle whose layout is one latent group (a V3 prefill worker's) is refused before any
    byte moves, with a message that says the two workers serve different kinds of model."""
    err = refused_handle(cluster, LayoutFingerprint.latent("v3-model", "float32", 4, 576, 64))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "different kinds of model" in (err.details() or "")
    assert "latent" in (err.details() or "") and "csa_kv" in (err.details() or "")
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)


def test_a_request_whose_decode_worker_is_killed_moves_on(cluster: Cluster, engine: Engine) -> None:
    """--migration-limit 1: kill -9 of the decode worker streaming a request. The request is
    prefilled again with what it had generated (its state recomputed from the tokens) and
    decoded on the other worker; the client gets the tokens of a request that never moved."""
    prompt, n = PROMPTS[1], 100
    params = sampling_params_to_pb(_greedy(n))
    tokens, killed_after, victim = kill_its_decode_worker(cluster, prompt, params, after=20)
    assert killed_after < n - 50, killed_after  # killed mid-stream
    assert tokens == engine.generate([prompt], _greedy(n))[0].token_ids
    assert cluster.logged(MIGRATING)
    cluster.wait_for("the kill seen", lambda: cluster.said(f"{victim} exited with code -9"), 10)
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)


def _decoders(cluster: Cluster) -> list[str]:
    return sorted(v.record.worker_id for v in cluster.views("decode"))
