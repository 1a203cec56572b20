"""KV-aware routing end to end: prefill workers publish their prefix-cache events to Redis
(``kv-events``), the scheduler follows them and sends a prompt to the worker that holds its
prefix (``kv_aware``, the default policy). Real redis-server, real `ferry up` processes."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import pytest

from ferry.services.common.cluster_state import ClusterState, KvEvents
from ferry.services.common.prefix_hash import prefix_hashes
from ferry.services.scheduler.prefix_index import PrefixIndex
from tests.cluster import Cluster, Result, ferry_up, generate, greedy
from tests.redis_server import RedisServer
from tests.waits import wait_until

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def cluster(redis: RedisServer) -> Iterator[Cluster]:
    with ferry_up(
        redis.url,
        "--prefill",
        "2",
        "--decode",
        "1",
        "--model",
        "tiny",
        "--worker-args",
        f"--block-size {BLOCK_SIZE}",
        cluster="kv",
    ) as c:
        yield c


def kv_events(c: Cluster) -> list[KvEvents]:
    """The whole kv-events stream, as a scheduler replays it."""

    async def read(state: ClusterState) -> list[KvEvents]:
        return (await state.read_kv_events("0", block_ms=0))[1]

    return c.read(read)


def holders(c: Cluster) -> PrefixIndex:
    """Which worker holds which block, replayed from the whole kv-events stream."""
    index = PrefixIndex()
    for batch in kv_events(c):
        index.apply(batch)
    return index


def test_a_prompt_goes_to_the_worker_that_holds_its_prefix(cluster: Cluster) -> None:
    c = cluster
    salt = c.views("prefill")[0].record.model_fingerprint.encode()
    long_a = [(5 * j) % 250 + 1 for j in range(2000)]  # its prefill keeps prefill-0 busy ...
    short_b = [(11 * j) % 250 + 1 for j in range(160)]  # ... while this one is routed
    (scheduler,) = c.views("scheduler")
    metrics = f"http://127.0.0.1:{scheduler.record.metrics_port}/metrics"

    def taken_in(n: int) -> None:
        """Until the scheduler has taken ``n`` requests in, which routes each: it counts one
        and picks its prefill worker in one step of its event loop."""
        running = "ferry_scheduler_running_requests"
        wait_until(f"{n} requests taken in", lambda: _sample(metrics, running) >= n, 30, 0.01)

    async def first_round() -> list[Result]:
        # both idle: A goes to prefill-0 (the lower id), where its prefill waits while the
        # worker is stopped, counted against it; B goes to prefill-1. (Stopped for less than
        # its record's ttl, 3 s, or the scheduler would take it for hung.)
        with c.stopped("prefill-0"):
            a = asyncio.create_task(generate(c.scheduler, long_a, greedy(2)))
            await asyncio.to_thread(taken_in, 1)
            b = asyncio.create_task(generate(c.scheduler, short_b, greedy(2)))
            await asyncio.to_thread(taken_in, 2)
        return [await a, await b]

    assert all(r.code is None for r in asyncio.run(first_round()))
    a_first = next(prefix_hashes(long_a, BLOCK_SIZE, salt))
    b_first = next(prefix_hashes(short_b, BLOCK_SIZE, salt))

    def published() -> bool:
        index = holders(c)
        return bool(index.overlap([a_first]) and index.overlap([b_first]))

    c.wait_for("both prefixes in kv-events", published, 5)
    where_a, where_b = holders(c).overlap([a_first]), holders(c).overlap([b_first])
    assert len(where_a) == len(where_b) == 1 and where_a.keys() != where_b.keys(), (
        where_a,
        where_b,
    )
    entries = len(kv_events(c))  # the scheduler's index has applied them all:
    applied = lambda: c.metric("scheduler-0", "ferry_scheduler_kv_event_batches_total") >= entries  # noqa: E731
    c.wait_for("the scheduler read the kv-events", applied, 10)

    # Follow-ups share a prefix. least_loaded would send both to prefill-0 (idle, lower id),
    # where B's prefix is not: B's first follow-up would compute all of it again.
    for i in range(3):
        for base in (short_b, long_a):
            follow_up = [*base, 200 + i, 201, 202]
            (r,) = asyncio.run(asyncio.wait_for(_one(c, follow_up), 60))
            assert r.code is None, r
            assert r.cached_tokens == len(base), (i, len(base), r.cached_tokens)
    c.wait_for("blocks free", c.all_blocks_free, 5)


async def _one(c: Cluster, prompt: list[int]) -> list[Result]:
    return [await generate(c.scheduler, prompt, greedy(2))]


def _sample(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith(name))
