"""ClusterView: the scheduler's picture of the live workers.

It reads the registry and load reports from Redis every ``refresh_s`` (never per token), adds
what this scheduler has routed since each report, and keeps a short list of workers whose calls
just failed (suspects) so that retries avoid them until their heartbeat key has expired. A call
in flight can ``watch`` its worker: the event is set when that worker process leaves the
registry (its heartbeat key expired: hung, or its host gone without closing the connection; a
worker that drains stays in it, marked draining, and gets nothing new). When
Redis restarts (its run id changes) the registry is empty until the next heartbeats; for one
TTL the view keeps the workers it knew, so a Redis restart is not an outage. Its PrefixIndex
(fed from the workers' KV events by :func:`prefix_index.follow`) tells how much of a prompt each
candidate holds.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ferry.services.common.cluster_state import (
    ClusterState,
    ClusterStateError,
    LoadReport,
    WorkerRecord,
    WorkerView,
)
from ferry.services.common.log import get_logger
from ferry.services.scheduler.policies import Candidate
from ferry.services.scheduler.prefix_index import PrefixIndex

log = get_logger(__name__)


@dataclass(frozen=True)
class _Routed:
    at: float  # time.time(), comparable with LoadReport.updated_at
    tokens: int
    blocks: int


class ClusterView:
    def __init__(self, cluster: ClusterState, refresh_s: float = 0.25, suspect_s: float = 3.0):
        self.cluster = cluster
        self.refresh_s = refresh_s
        self.suspect_s = suspect_s
        self._every: list[WorkerView] = []  # draining workers included
        self._views: list[WorkerView] = []  # those that take new work
        self._routed: dict[str, dict[int, _Routed]] = {}
        self._suspects: dict[str, float] = {}  # worker id -> monotonic time it failed
        self._ids = itertools.count()
        self._redis_down = False
        self._server_id = ""
        self._restarted_at = -float("inf")
        self._watched: dict[tuple[str, int, float], tuple[asyncio.Event, int]] = {}
        self.prefix = PrefixIndex()

    async def refresh(self) -> None:
        try:
            server_id = await self.cluster.server_id()
            views = await self.cluster.workers(include_draining=True)
            now = time.monotonic()
            if self._server_id and server_id != self._server_id:
                log.warning("redis restarted; keeping known workers while they re-register")
                self._restarted_at = now
            self._server_id = server_id
            if now - self._restarted_at < self.suspect_s:
                views = _merge(views, self._every)
            self._every = views
            self._views = [v for v in views if not v.record.draining]
            self.prefix.retain({v.record.worker_id for v in self._views})
            self._mark_gone({v.record.process for v in views})  # draining is not gone
            if self._redis_down:
                log.info("cluster state reachable again")
            self._redis_down = False
        except ClusterStateError as e:  # keep serving from the last snapshot while Redis is away
            if not self._redis_down:
                log.warning("cluster state unreachable; using the last snapshot", error=str(e))
            self._redis_down = True

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    def workers(self, role: str | None = None) -> list[WorkerView]:
        return [v for v in self._views if role is None or v.record.role == role]

    def candidates(
        self, role: str, exclude: Collection[str] = (), block_hashes: Sequence[int] = ()
    ) -> list[Candidate]:
        """Live workers of ``role`` not in ``exclude``; suspects only when nothing else is left.
        With ``block_hashes`` (a prompt's), each says how many leading blocks of it it holds."""
        now = time.monotonic()
        self._suspects = {w: t for w, t in self._suspects.items() if now - t < self.suspect_s}
        views = [v for v in self.workers(role) if v.record.worker_id not in exclude]
        healthy = [v for v in views if v.record.worker_id not in self._suspects]
        cached = self.prefix.overlap(block_hashes)
        return [self._candidate(v, cached.get(v.record.worker_id, 0)) for v in (healthy or views)]

    def _candidate(self, view: WorkerView, cached_blocks: int) -> Candidate:
        load = view.load or LoadReport()
        since = [
            r
            for r in self._routed.get(view.record.worker_id, {}).values()
            if r.at > load.updated_at
        ]
        return Candidate(
            view.record,
            load,
            len(since),
            sum(r.tokens for r in since),
            sum(r.blocks for r in since),
            cached_blocks,
        )

    @contextmanager
    def routed(self, worker_id: str, tokens: int = 0, blocks: int = 0) -> Iterator[None]:
        """Count a request against ``worker_id`` while it runs there."""
        key = next(self._ids)
        entries = self._routed.setdefault(worker_id, {})
        entries[key] = _Routed(time.time(), tokens, blocks)
        try:
            yield
        finally:
            entries.pop(key, None)

    @contextmanager
    def watch(self, record: WorkerRecord) -> Iterator[asyncio.Event]:
        """An event set if ``record``'s process leaves the registry while the block runs (its
        heartbeat key expired, or another process registered under its id)."""
        key = record.process
        event, users = self._watched.get(key, (asyncio.Event(), 0))
        self._watched[key] = (event, users + 1)
        try:
            yield event
        finally:
            event, users = self._watched[key]
            if users > 1:
                self._watched[key] = (event, users - 1)
            else:
                del self._watched[key]

    def _mark_gone(self, live: set[tuple[str, int, float]]) -> None:
        for key, (event, _) in self._watched.items():
            if key not in live and not event.is_set():
                log.warning(
                    "worker_gone",
                    worker_id=key[0],
                    pid=key[1],
                    why="its heartbeat key expired or another process took its id",
                )
                event.set()

    def suspect(self, worker_id: str) -> None:
        """A call to ``worker_id`` failed as if it were down: avoid it for a while."""
        self._suspects[worker_id] = time.monotonic()

    def max_model_len(self) -> int:
        """The smallest length limit among the workers a request starts on, prefill and
        aggregated (0 when none is registered)."""
        lens = [
            v.record.max_model_len
            for v in self.workers()
            if v.record.role in ("prefill", "aggregated") and v.record.max_model_len
        ]
        return min(lens, default=0)


def _merge(fresh: list[WorkerView], known: list[WorkerView]) -> list[WorkerView]:
    """``fresh`` plus the ``known`` workers it lacks: after a Redis restart the registry is empty
    until each worker's next heartbeat, but the workers themselves are still there."""
    ids = {v.record.worker_id for v in fresh}
    return sorted(
        [*fresh, *(v for v in known if v.record.worker_id not in ids)],
        key=lambda v: v.record.worker_id,
    )
