"""DeepSeek-V4.1 through a disaggregated cluster: `ferry up --model v41-tiny` (1 prefill, 1
decode, UCX). The prefill worker hands each request's blocks and its state slot (every layer's
window, the ratio-2 source's open row, Engram's look-back) to the decode worker, which continues
from them: greedy outputs through the REST API and the scheduler equal the in-process engine's,
for prompts of both parities; a repeated prompt hits the prefill worker's snapshot. After each
test every KV block and state slot is free on every worker. Both with the model's cache and the
FP8 one (``--kv-cache-dtype fp8``: its packed rows are what travels)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import pytest

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, ferry_up, generate, generate_twice, greedy

pytestmark = pytest.mark.slow  # ~1 min a cache dtype: `make test-slow`

# lengths 9, 30, 51, 72: both parities (ratio 2), past the window (16) and several blocks
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(9 + 21 * i)] for i in range(4)]
TOKENS = 10


@pytest.fixture(scope="module", params=["auto", "fp8"])
def kv_cache_dtype(request: pytest.FixtureRequest) -> str:
    dtype: str = request.param
    return dtype


@pytest.fixture(scope="module")
def cluster(kv_cache_dtype: str) -> Iterator[Cluster]:
    args = ("--model", "v41-tiny", "--kv-transport", "ucx", "--kv-cache-dtype", kv_cache_dtype)
    with ferry_up("", *args, cluster="v41") as c:
        yield c


@pytest.fixture(scope="module")
def engine(kv_cache_dtype: str) -> Engine:
    return Engine(EngineConfig(model="v41-tiny", kv_cache_dtype=kv_cache_dtype))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _complete(cluster: Cluster, prompt: list[int]) -> str:
    body = {"model": "v41-tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    body["ignore_eos"] = True
    req = urllib.request.Request(
        cluster.gateway + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        text: str = json.loads(r.read())["choices"][0]["text"]
    return text


def test_greedy_outputs_through_p_d_equal_the_in_process_engine(
    cluster: Cluster, engine: Engine
) -> None:
    want = [engine.generate([p], _greedy(TOKENS))[0] for p in PROMPTS]
    assert [_complete(cluster, p) for p in PROMPTS] == [w.text for w in want]

    async def together() -> list[list[int]]:
        rs = await asyncio.gather(
            *(generate(cluster.scheduler, p, greedy(TOKENS, ignore_eos=True)) for p in PROMPTS)
        )
        assert all(r.code is None for r in rs), [r.details for r in rs]
        return [r.token_ids for r in rs]

    assert asyncio.run(together()) == [w.token_ids for w in want]
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)


def test_a_repeated_prompt_hits_the_prefill_workers_snapshot(
    cluster: Cluster, engine: Engine
) -> None:
    prompt = PROMPTS[3]
    (want,) = engine.generate([prompt], _greedy(TOKENS))
    (first, _), (again, cached) = generate_twice(cluster, prompt, TOKENS)
    assert first == again == want.token_ids
    assert cached == 64  # the prompt's last block boundary (block size 64) before token 72
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)
