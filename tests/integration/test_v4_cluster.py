"""DeepSeek-V4 served: `ferry up --model v4-tiny` with no worker flags starts an aggregated
worker (P/D hand-offs do not carry V4's per-request state yet, and it says so), whose greedy
outputs are the in-process engine's, a repeated prompt served from its prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, ferry_up, generate, greedy

PROMPTS = [[(11 * i + 5 * j) % 250 + 1 for j in range(9 + 37 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with ferry_up("", "--model", "v4-tiny", cluster="v4") as c:
        yield c


def test_v4_starts_aggregated_and_says_why(cluster: Cluster) -> None:
    assert sorted(v.record.role for v in cluster.views()) == ["aggregated", "scheduler"]
    assert cluster.said("DeepSeek-V4 runs aggregated")


def test_greedy_outputs_equal_the_in_process_engine(cluster: Cluster) -> None:
    engine = Engine(EngineConfig(model="v4-tiny"))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [engine.generate([p], params)[0].token_ids for p in PROMPTS]

    async def main() -> list[list[int]]:
        outs = []
        for p in [*PROMPTS, PROMPTS[2]]:  # one at a time: the batches the engine ran
            r = await generate(cluster.scheduler, p, greedy(10, ignore_eos=True))
            assert r.code is None, r.details
            outs.append((r.token_ids, r.cached_tokens))
        return outs

    got = asyncio.run(main())
    assert [t for t, _ in got] == [*want, want[2]]
    assert got[2][1] == 0 and got[3][1] == 64  # the repeat hit its prompt's snapshot
    cluster.wait_for("every KV block free", cluster.all_blocks_free, 10.0)
