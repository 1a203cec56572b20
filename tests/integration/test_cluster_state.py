"""ClusterState against a real redis-server: registry, expiry, restarts, isolation, errors."""

from __future__ import annotations

import asyncio

import pytest

from ferry.infra.ports import free_port
from ferry.services.common.cluster_state import (
    ClusterState,
    ClusterStateError,
    KvEvents,
    LoadReport,
    WorkerRecord,
    parse_redis_url,
)
from tests.redis_server import RedisServer
from tests.waits import wait_until_async


def record(wid: str, role: str = "decode") -> WorkerRecord:
    return WorkerRecord(wid, role, "127.0.0.1:1234", num_kv_blocks=64, pid=42)


def test_register_reads_back_record_and_load(redis: RedisServer) -> None:
    async def main() -> None:
        worker, reader = ClusterState(redis.url, "read"), ClusterState(redis.url, "read")
        load = LoadReport(running=3, free_kv_blocks=60, total_kv_blocks=64, updated_at=1.5)
        await worker.register(record("decode-0"), lambda: load)
        await ClusterState(redis.url, "read").register(record("prefill-0", "prefill"))
        (view,) = await reader.workers("decode")
        assert view.record == record("decode-0") and view.load == load
        prefill = await reader.workers("prefill")
        assert [v.record.worker_id for v in prefill] == ["prefill-0"] and prefill[0].load is None
        await worker.close()
        assert [v.record.worker_id for v in await reader.workers()] == ["prefill-0"]
        await reader.close()

    asyncio.run(main())


def test_deregister_ends_even_when_the_cancel_lands_inside_a_heartbeat_write(
    redis: RedisServer,
) -> None:
    """redis-py can swallow a cancellation inside a pipeline's execute; deregister() must still
    end, with its heartbeat loop (nothing writes the record again), and leave no record behind,
    whenever it comes (heartbeats every 0.5 ms here)."""

    async def main() -> None:
        reader = ClusterState(redis.url, "deregister")
        for i in range(60):
            worker = ClusterState(redis.url, "deregister", heartbeat_s=0.0005)
            await worker.register(record(f"decode-{i}"), lambda: LoadReport(updated_at=1.0))
            beat = worker._beat
            await asyncio.sleep(0.001 * (i % 7))  # lands anywhere in a beat
            task = asyncio.ensure_future(worker.deregister())
            done, _ = await asyncio.wait({task}, timeout=3.0)
            assert task in done, f"deregister #{i} did not end"
            assert beat is not None and beat.done(), f"deregister #{i} left its heartbeat on"
            await worker.close()
        assert await reader.workers() == []
        await reader.close()

    asyncio.run(main())


def test_a_worker_that_stops_beating_expires_within_the_ttl(redis: RedisServer) -> None:
    """Beats (every 0.1 s) keep the record past its ttl (1 s); once they stop, Redis holds it
    for at most the ttl. Counted in beats and read from Redis's own expiry, not timed here."""

    async def main() -> None:
        beats = 0

        def load() -> LoadReport:
            nonlocal beats
            beats += 1
            return LoadReport()

        worker = ClusterState(redis.url, "expiry", heartbeat_s=0.1, ttl_s=1.0)
        reader = ClusterState(redis.url, "expiry")
        await worker.register(record("decode-0"), load)
        # a beat comes at least heartbeat_s after the one before: 12 beats span more than the ttl
        await wait_until_async("12 beats", lambda: beats > 12, 30)
        assert len(await reader.workers()) == 1
        assert worker._beat is not None
        # the process "dies": no deregister, no more beats. redis-py can swallow a cancel that
        # lands inside a pipeline's execute, so the loop is also told to stop, and the ttl
        # counts from when it has (its last beat may be the one that was running)
        worker._record = None
        worker._beat.cancel()
        await asyncio.gather(worker._beat, return_exceptions=True)
        left_ms = await reader.redis.pttl(reader.key("worker", "decode-0"))
        assert 0 < left_ms <= 1000 or left_ms == -2, left_ms  # -2: expired already
        await wait_until_async("the record expired", lambda: _empty(reader), 10)
        await reader.close()

    asyncio.run(main())


async def _empty(state: ClusterState) -> bool:
    return not await state.workers()


def test_heartbeats_re_register_after_a_redis_restart(redis: RedisServer) -> None:
    async def main() -> None:
        worker = ClusterState(redis.url, "restart", heartbeat_s=0.1, ttl_s=1.0)
        await worker.register(record("decode-0"), LoadReport)
        redis.restart()  # an empty server on the same port
        reader = ClusterState(redis.url, "restart")

        async def back() -> bool:
            return len(await reader.workers()) == 1

        await wait_until_async("re-registered", back, 10)
        assert worker.healthy
        await worker.close()
        await reader.close()

    asyncio.run(main())


def test_two_clusters_on_one_redis_do_not_see_each_other(redis: RedisServer) -> None:
    async def main() -> None:
        a, b = ClusterState(redis.url, "a"), ClusterState(redis.url, "b")
        await a.register(record("w-0"))
        await b.register(record("w-1"))
        assert [v.record.worker_id for v in await a.workers()] == ["w-0"]
        assert [v.record.worker_id for v in await b.workers()] == ["w-1"]
        await a.close()
        await b.close()

    asyncio.run(main())


def test_an_unreachable_redis_is_a_clear_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"

    async def main() -> None:
        state = ClusterState(url, "c")
        with pytest.raises(ClusterStateError, match=f"cannot reach Redis at {url}"):
            await state.register(record("decode-0"))
        with pytest.raises(ClusterStateError, match="cannot reach Redis"):
            await state.workers()
        assert not await state.ping()
        await state.close()

    asyncio.run(main())


def test_a_malformed_url_names_the_expected_forms() -> None:
    with pytest.raises(ValueError, match="expected redis://host:port/db"):
        parse_redis_url("http://127.0.0.1:6379")


def test_kv_events_read_back_in_order_past_a_malformed_entry(redis: RedisServer) -> None:
    async def main() -> None:
        state = ClusterState(redis.url, "kv")
        try:
            first = KvEvents("p0", [(True, 1), (True, 2)], cleared=True)
            await state.publish_kv_events(first)
            await state.redis.xadd(state.key("kv-events"), {"events": "+zz"})  # not ours
            await state.publish_kv_events(KvEvents("p0", [(False, 2)]))
            last, batches = await state.read_kv_events("0", block_ms=0)
            assert batches == [first, KvEvents("p0", [(False, 2)])]
            assert await state.read_kv_events(last, block_ms=10) == (last, [])
        finally:
            await state.close()

    asyncio.run(main())
