"""A decode DEP group inside a real `ferry up` cluster: two rank processes joined by gloo,
each a worker of its own in Redis, serve the in-process engine's greedy tokens; a rank killed
mid-stream makes its peer fail its requests within the group timeout and leave the registry,
new requests go to the remaining decode worker, and `ferry up` starts the group over."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, Result, ferry_up, generate, greedy
from tests.redis_server import RedisServer

WORKER_ARGS = "--block-size 16 --dep-timeout 3"


@pytest.fixture(scope="module")
def cluster(redis: RedisServer) -> Iterator[Cluster]:
    with ferry_up(
        redis.url,
        "--decode",
        "0",
        "--decode-dep",
        "2",
        "--num-redundant-experts",
        "2",
        "--num-kv-blocks",
        "256",
        "--worker-args",
        WORKER_ARGS,
        cluster="dep",
    ) as c:
        yield c


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(5 + 13 * i)] for i in range(n)]


def run(*coros: object) -> list[Result]:
    async def main() -> list[Result]:
        return list(await asyncio.gather(*coros))  # type: ignore[arg-type]

    return asyncio.run(main())


def assert_in_process_tokens(cluster: Cluster, ps: list[list[int]], n: int) -> None:
    """Greedy requests through the cluster, all at once, give the in-process engine's tokens."""
    results = run(*(generate(cluster.scheduler, p, greedy(n, ignore_eos=True)) for p in ps))
    engine = Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=256))
    expected = engine.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for res, ref in zip(results, expected, strict=True):
        assert res.code is None, res.details
        assert res.token_ids == ref.token_ids


def test_ranks_register_with_their_group(cluster: Cluster) -> None:
    ranks = {v.record.worker_id: v.record for v in cluster.views("decode")}
    assert sorted(ranks) == ["decode-r0", "decode-r1"]
    assert ranks["decode-r0"].dep_group
    assert ranks["decode-r0"].dep_group == ranks["decode-r1"].dep_group
    assert [ranks[w].dep_rank for w in ("decode-r0", "decode-r1")] == [0, 1]


def test_a_dep_group_serves_the_in_process_greedy_tokens(cluster: Cluster) -> None:
    assert_in_process_tokens(cluster, prompts(16), 10)
    loads = [v.load for v in cluster.views("decode")]
    assert all(ld is not None for ld in loads)
    # each rank publishes its expert-load window for the EPLB controller
    group = cluster.views("decode")[0].record.dep_group

    def published() -> dict[int, list[list[int]]]:
        return cluster.read(lambda state: state.expert_load(group))

    cluster.wait_for(
        "expert load published",
        lambda: (
            sorted(published()) == [0, 1]
            and all(sum(map(sum, c)) > 0 for c in published().values())
        ),
        5,
    )
    windows = published()
    assert len(windows[0]) == 3 and len(windows[0][0]) == 16  # MoE layers x logical experts


def test_a_killed_rank_fails_its_group_and_the_group_restarts(redis: RedisServer) -> None:
    """A cluster with the group and one independent decode worker: after decode-r1 is killed,
    decode-r0's requests fail within the group timeout, the group leaves the registry, and new
    requests go to decode-0. `ferry up` then starts both ranks over as a new group (a new
    master), which serves once decode-0 is gone."""
    with ferry_up(
        redis.url,
        "--decode",
        "1",
        "--decode-dep",
        "2",
        "--num-kv-blocks",
        "256",
        "--worker-args",
        WORKER_ARGS,
        cluster="dep-kill",
    ) as c:
        (group,) = {v.record.dep_group for v in c.views("decode") if v.record.dep_group}

        async def main() -> tuple[list[Result], float]:
            tasks = [
                asyncio.create_task(
                    generate(c.scheduler, p, greedy(400, ignore_eos=True), timeout=60)
                )
                for p in prompts(6)
            ]

            def all_decoding() -> bool:  # as the load reports say
                return sum(v.load.running for v in c.views("decode") if v.load) == 6

            await asyncio.to_thread(c.wait_for, "every request decoding", all_decoding, 30)
            c.signal("decode-r1", signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks)
            return list(results), time.monotonic() - killed

        results, took = asyncio.run(main())
        failed = [r for r in results if r.code is not None]
        seen = [(r.code, len(r.token_ids), r.details) for r in results]
        assert failed, f"the group's requests must fail: {seen}"
        assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in failed), seen
        assert any(r.code is None for r in results), f"decode-0's own requests finish: {seen}"
        assert took < 30, f"the group's requests took {took:.1f} s to fail: {seen}"
        dead = {c.pids["decode-r0"], c.pids["decode-r1"]}
        gone = lambda: not dead & {v.record.pid for v in c.views()}  # noqa: E731
        c.wait_for("the group left the registry", gone, 15)
        after = run(*(generate(c.scheduler, p, greedy(5, ignore_eos=True)) for p in prompts(4)))
        assert all(r.code is None and len(r.token_ids) == 5 for r in after), after

        for rank in ("decode-r0", "decode-r1"):
            c.restarted(rank, 90)
        serving = lambda: c.said("decode-dep is serving again")  # noqa: E731
        c.wait_for("the group serving", serving, 30)
        ranks = [v.record for v in c.views("decode") if v.record.dep_group]
        assert len(ranks) == 2 and len({r.dep_group for r in ranks}) == 1
        assert group not in {r.dep_group for r in ranks}, "a new master names a new group"
        c.signal("decode-0", signal.SIGTERM)  # a clean exit: it stays down
        c.wait_for(
            "decode-0 left", lambda: "decode-0" not in {v.record.worker_id for v in c.views()}, 5
        )
        again = run(*(generate(c.scheduler, p, greedy(5, ignore_eos=True)) for p in prompts(4)))
        assert all(r.code is None and len(r.token_ids) == 5 for r in again), again


def test_a_prefill_dep_group_serves_the_in_process_greedy_tokens(redis: RedisServer) -> None:
    with ferry_up(
        redis.url,
        "--prefill",
        "0",
        "--prefill-dep",
        "2",
        "--decode",
        "1",
        "--num-kv-blocks",
        "256",
        "--worker-args",
        WORKER_ARGS,
        cluster="dep-prefill",
    ) as c:
        assert sorted(v.record.worker_id for v in c.views("prefill")) == [
            "prefill-r0",
            "prefill-r1",
        ]
        assert_in_process_tokens(c, prompts(12), 6)
