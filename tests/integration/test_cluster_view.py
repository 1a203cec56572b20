"""ClusterView.watch against a real redis-server: a call in flight learns that its worker
process left the registry (its heartbeat key expired, or another process took its id), and not
that it drains."""

from __future__ import annotations

import asyncio

from ferry.services.common import tasks
from ferry.services.common.cluster_state import ClusterState, LoadReport, WorkerRecord
from ferry.services.scheduler.cluster_view import ClusterView
from tests.redis_server import RedisServer
from tests.waits import wait_until_async

# a worker beats every 0.1 s and its record outlives its last beat by 1 s: 12 beats, each at
# least 0.1 s after the one before, outlast the ttl (counted, not timed)
BEATS = {"ttl_s": 1.0, "heartbeat_s": 0.1}
PAST_THE_TTL = 12


def _record(wid: str, pid: int) -> WorkerRecord:
    return WorkerRecord(wid, "decode", "127.0.0.1:1234", pid=pid, started_at=float(pid))


class Beats:
    """A worker's load report that counts the heartbeats that send it."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> LoadReport:
        self.count += 1
        return LoadReport()

    async def past_the_ttl(self) -> None:
        """Until PAST_THE_TTL more beats have been sent."""
        until = self.count + PAST_THE_TTL
        await wait_until_async("beats past the ttl", lambda: self.count >= until, 30)


def test_a_watched_worker_that_stops_beating_or_is_replaced_is_marked_gone(
    redis: RedisServer,
) -> None:
    async def main() -> None:
        hung, restarted = (
            ClusterState(redis.url, "gone", **BEATS),
            ClusterState(redis.url, "gone", **BEATS),
        )
        beats = Beats()
        await hung.register(_record("decode-0", 10), beats)
        await restarted.register(_record("decode-1", 20), LoadReport)
        reader = ClusterState(redis.url, "gone")
        view = ClusterView(reader, refresh_s=0.05)
        await view.refresh()
        d0, d1 = (v.record for v in view.workers())
        runner = asyncio.create_task(view.run())
        replacement = ClusterState(redis.url, "gone", **BEATS)
        try:
            with view.watch(d0) as gone0, view.watch(d1) as gone1, view.watch(d1) as again:
                assert again is gone1  # one event per worker process, however many calls
                await beats.past_the_ttl()  # heartbeats keep both registered past the ttl
                await view.refresh()
                assert not gone0.is_set() and not gone1.is_set()
                assert hung._beat is not None
                # hangs: no more beats, no deregister (the loop told to stop too: redis-py can
                # swallow a cancel that lands inside a write)
                hung._record = None
                await tasks.stop(hung._beat)
                await asyncio.wait_for(gone0.wait(), 10)
                assert not gone1.is_set()
                await restarted.close()  # decode-1 restarts: a new process under its id
                await replacement.register(_record("decode-1", 21), LoadReport)
                await asyncio.wait_for(gone1.wait(), 10)
            assert view._watched == {}  # nothing kept once the calls are over
        finally:
            await tasks.stop(runner)  # (redis-py can swallow one cancel)
            for state in (hung, replacement, reader):
                await state.close()

    asyncio.run(main())


def test_a_draining_worker_gets_nothing_new_and_its_calls_are_not_cut(redis: RedisServer) -> None:
    """drain() keeps the worker registered, marked draining: no longer a candidate, but a call
    in flight on it runs on; when it then stops beating it is gone like any other."""

    async def main() -> None:
        worker = ClusterState(redis.url, "draining", **BEATS)
        beats = Beats()
        await worker.register(_record("decode-0", 10), beats)
        reader = ClusterState(redis.url, "draining")
        view = ClusterView(reader, refresh_s=0.05)
        await view.refresh()
        (d0,) = (v.record for v in view.workers())
        runner = asyncio.create_task(view.run())
        try:
            with view.watch(d0) as gone:
                await worker.drain()
                await beats.past_the_ttl()  # the heartbeat goes on while draining
                await view.refresh()
                assert view.workers() == [] and view.candidates("decode") == []
                assert not gone.is_set()
                (listed,) = await reader.workers(include_draining=True)
                assert listed.record.draining and listed.record.process == d0.process
                assert await reader.workers() == []
                await worker.close()  # done: leaves the registry
                await asyncio.wait_for(gone.wait(), 10)
        finally:
            await tasks.stop(runner)  # (redis-py can swallow one cancel)
            await reader.close()

    asyncio.run(main())
