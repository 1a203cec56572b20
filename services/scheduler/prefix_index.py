"""PrefixIndex: which worker holds which prompt prefix in its KV cache, from the KV events the
workers publish (like Dynamo's KV router's radix index, flattened: a block hash chains every
token before it, so one hash names a whole prefix).

A worker whose model keeps per-request state (DeepSeek-V4: ``KvEvents.stateful``) serves a hit only
up to a block whose end it kept a state snapshot of; it reports those too, and its overlap ends at
the last such block of the prefix it holds.

The index is a routing hint, not the truth: events arrive up to a publishing period late and
can be lost while Redis is away (the worker then starts over with a snapshot). A wrong hint
costs a cache miss, never a wrong answer: the worker matches prefixes itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence

from ferry.services.common.cluster_state import ClusterState, ClusterStateError, KvEvents
from ferry.services.common.log import get_logger
from ferry.services.scheduler import metrics

log = get_logger(__name__)


class PrefixIndex:
    def __init__(self, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s
        self._holders: dict[int, set[str]] = {}  # block hash -> workers that hold it
        self._held: dict[str, set[int]] = {}  # worker -> block hashes it holds
        self._heard: dict[str, float] = {}  # worker -> monotonic time of its last events
        self._snapshots: dict[str, set[int]] = {}  # stateful worker -> blocks ending a snapshot

    def apply(self, batch: KvEvents) -> None:
        if batch.cleared:
            self.forget(batch.worker_id)
        self._heard[batch.worker_id] = time.monotonic()
        if batch.stateful:
            snaps = self._snapshots.setdefault(batch.worker_id, set())
            for kept, block_hash in batch.snapshots:
                if kept:
                    snaps.add(block_hash)
                else:
                    snaps.discard(block_hash)
        held = self._held.setdefault(batch.worker_id, set())
        for stored, block_hash in batch.events:
            if stored:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(batch.worker_id)
            elif block_hash in held:
                held.discard(block_hash)
                holders = self._holders[block_hash]
                holders.discard(batch.worker_id)
                if not holders:
                    del self._holders[block_hash]

    def forget(self, worker_id: str) -> None:
        self._heard.pop(worker_id, None)
        self._snapshots.pop(worker_id, None)
        for block_hash in self._held.pop(worker_id, ()):
            holders = self._holders[block_hash]
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]

    def retain(self, worker_ids: Collection[str], now: float | None = None) -> None:
        """Forget the workers not in ``worker_ids`` (the registry) and not heard from for
        ``grace_s``: they left. (A worker's first events can come before the registry shows it,
        and a scheduler that starts reads the events of workers long gone.)"""
        now = time.monotonic() if now is None else now
        gone = [w for w, t in self._heard.items() if w not in worker_ids and now - t > self.grace_s]
        for worker_id in gone:
            self.forget(worker_id)

    def overlap(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker that holds the first block: how many leading blocks of the prompt
        (given by their chained hashes) it holds; for a stateful worker, up to the last of them
        it kept a state snapshot at."""
        if not block_hashes:
            return {}
        counts = dict.fromkeys(self._holders.get(block_hashes[0], ()), 1)
        live = set(counts)
        for block_hash in block_hashes[1:]:
            live &= self._holders.get(block_hash, set())
            if not live:
                break
            for worker_id in live:
                counts[worker_id] += 1
        for worker_id, snaps in self._snapshots.items():
            if worker_id in counts:
                held = counts[worker_id]
                counts[worker_id] = next(
                    (k for k in range(held, 0, -1) if block_hashes[k - 1] in snaps), 0
                )
        return counts

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def workers(self) -> set[str]:
        """The workers the index knows (whether or not they hold a block)."""
        return set(self._held) | set(self._heard)


async def follow(cluster: ClusterState, index: PrefixIndex, retry_s: float = 1.0) -> None:
    """Apply every ``kv-events`` entry to ``index``, from the oldest kept, until cancelled."""
    after = "0"
    down = False
    while True:
        try:
            after, batches = await cluster.read_kv_events(after)
        except ClusterStateError as e:
            if not down:
                log.warning("kv events unreachable; routing on the last index", error=str(e))
            down = True
            await asyncio.sleep(retry_s)
            continue
        down = False
        for batch in batches:
            index.apply(batch)
        metrics.KV_EVENT_BATCHES.inc(len(batches))
