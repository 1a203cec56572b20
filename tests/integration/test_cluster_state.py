"""ClusterState against a real redis-server: registry, expiry, restarts, isolation, errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

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
from tests.redis_server import RedisServer, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def record(wid: str, role: str = "decode") -> WorkerRecord:
    return WorkerRecord(wid, role, "127.0.0.1:1234", num_kv_blocks=64, pid=42)


async def wait_until(ok: object, timeout: float) -> float:
    started = time.monotonic()
    while not await ok():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, f"not within {timeout}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_register_reads_back_record_and_load(redis: RedisServer) -> None:
    async def main() -> None:
        worker, reader = ClusterState(redis.url, "c"), ClusterState(redis.url, "c")
        load = LoadReport(running=3, free_kv_blocks=60, total_kv_blocks=64, updated_at=1.5)
        await worker.register(record("decode-0"), lambda: load)
        await ClusterState(redis.url, "c").register(record("prefill-0", "prefill"))
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
    end, and leave no record behind, whenever it comes (heartbeats every 0.5 ms here)."""

    async def main() -> None:
        reader = ClusterState(redis.url, "c")
        for i in range(60):
            worker = ClusterState(redis.url, "c", heartbeat_s=0.0005)
            await worker.register(record(f"decode-{i}"), lambda: LoadReport(updated_at=1.0))
            await asyncio.sleep(0.001 * (i % 7))
            task = asyncio.ensure_future(worker.deregister())
            done, _ = await asyncio.wait({task}, timeout=3.0)
            assert task in done, f"deregister #{i} did not end"
            await worker.close()
        await asyncio.sleep(0.05)
        assert await reader.workers() == []
        await reader.close()

    asyncio.run(main())


def test_a_worker_that_stops_beating_expires_within_the_ttl(redis: RedisServer) -> None:
    async def main() -> None:
        worker = ClusterState(redis.url, "c", heartbeat_s=0.1, ttl_s=0.5)
        reader = ClusterState(redis.url, "c")
        await worker.register(record("decode-0"), LoadReport)
        await asyncio.sleep(1.0)  # heartbeats keep it alive past the ttl
        assert len(await reader.workers()) == 1
        assert worker._beat is not None
        # the process "dies": no deregister, no more beats. redis-py can swallow a cancel that
        # lands inside a pipeline's execute, so the loop is also told to stop, and the ttl
        # counts from when it has (its last beat may be the one that was running)
        worker._record = None
        worker._beat.cancel()
        await asyncio.gather(worker._beat, return_exceptions=True)
        took = await wait_until(lambda: _empty(reader), 2.0)
        assert took < 0.8
        await reader.close()

    asyncio.run(main())


async def _empty(state: ClusterState) -> bool:
    return not await state.workers()


def test_heartbeats_re_register_after_a_redis_restart(redis: RedisServer) -> None:
    async def main() -> None:
        worker = ClusterState(redis.url, "c", heartbeat_s=0.1, ttl_s=1.0)
        await worker.register(record("decode-0"), LoadReport)
        redis.restart()  # an empty server on the same port
        reader = ClusterState(redis.url, "c")

        async def back() -> bool:
            return len(await reader.workers()) == 1

        await wait_until(back, 3.0)
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
