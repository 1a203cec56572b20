"""ClusterView.watch against a real redis-server: a call in flight learns that its worker
process left the registry (its heartbeat key expired, or another process took its id), and not
that it drains."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from ferry.services.common.cluster_state import ClusterState, LoadReport, WorkerRecord
from ferry.services.scheduler.cluster_view import ClusterView
from tests.redis_server import RedisServer, redis_server


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def _record(wid: str, pid: int) -> WorkerRecord:
    return WorkerRecord(wid, "decode", "127.0.0.1:1234", pid=pid, started_at=float(pid))


def test_a_watched_worker_that_stops_beating_or_is_replaced_is_marked_gone(
    redis: RedisServer,
) -> None:
    async def main() -> None:
        beats = {"ttl_s": 0.5, "heartbeat_s": 0.1}
        hung, restarted = (
            ClusterState(redis.url, "c", **beats),
            ClusterState(redis.url, "c", **beats),
        )
        await hung.register(_record("decode-0", 10), LoadReport)
        await restarted.register(_record("decode-1", 20), LoadReport)
        reader = ClusterState(redis.url, "c")
        view = ClusterView(reader, refresh_s=0.05)
        await view.refresh()
        d0, d1 = (v.record for v in view.workers())
        runner = asyncio.create_task(view.run())
        replacement = ClusterState(redis.url, "c", **beats)
        try:
            with view.watch(d0) as gone0, view.watch(d1) as gone1, view.watch(d1) as again:
                assert again is gone1  # one event per worker process, however many calls
                await asyncio.sleep(1.0)  # heartbeats keep both registered past the ttl
                assert not gone0.is_set() and not gone1.is_set()
                assert hung._beat is not None
                hung._beat.cancel()  # hangs: no more beats, no deregister
                await asyncio.wait_for(gone0.wait(), 2.0)
                assert not gone1.is_set()
                await restarted.close()  # decode-1 restarts: a new process under its id
                await replacement.register(_record("decode-1", 21), LoadReport)
                await asyncio.wait_for(gone1.wait(), 2.0)
            assert view._watched == {}  # nothing kept once the calls are over
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            for state in (hung, replacement, reader):
                await state.close()

    asyncio.run(main())


def test_a_draining_worker_gets_nothing_new_and_its_calls_are_not_cut(redis: RedisServer) -> None:
    """drain() keeps the worker registered, marked draining: no longer a candidate, but a call
    in flight on it runs on; when it then stops beating it is gone like any other."""

    async def main() -> None:
        worker = ClusterState(redis.url, "c", ttl_s=0.5, heartbeat_s=0.1)
        await worker.register(_record("decode-0", 10), LoadReport)
        reader = ClusterState(redis.url, "c")
        view = ClusterView(reader, refresh_s=0.05)
        await view.refresh()
        (d0,) = (v.record for v in view.workers())
        runner = asyncio.create_task(view.run())
        try:
            with view.watch(d0) as gone:
                await worker.drain()
                await asyncio.sleep(1.0)  # past the ttl: the heartbeat goes on while draining
                assert view.workers() == [] and view.candidates("decode") == []
                assert not gone.is_set()
                (listed,) = await reader.workers(include_draining=True)
                assert listed.record.draining and listed.record.process == d0.process
                assert await reader.workers() == []
                await worker.close()  # done: leaves the registry
                await asyncio.wait_for(gone.wait(), 2.0)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await reader.close()

    asyncio.run(main())
