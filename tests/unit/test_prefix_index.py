"""PrefixIndex: the scheduler's map of which worker holds which prompt prefix, fed by the KV
events of real KVCacheManagers (as workers publish them, through their wire encoding)."""

from __future__ import annotations

import time

from ferry.services.common.cluster_state import KvEvents
from ferry.services.common.prefix_hash import prefix_hashes
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.scheduler.prefix_index import PrefixIndex
from tests.helpers import make_request
from tests.unit.test_kv_cache import run_prefill

BS = 4


def publish(index: PrefixIndex, worker: str, kv: KVCacheManager, cleared: bool = False) -> None:
    batch = KvEvents(worker, kv.take_events(snapshot=cleared), cleared)
    index.apply(KvEvents.decode(batch.encode()))


def worker_cache() -> KVCacheManager:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.record_events()
    return kv


def test_events_round_trip_their_wire_form() -> None:
    batch = KvEvents("p0", [(True, 2**64 - 1), (False, 0), (True, 0xABC)], cleared=True)
    assert KvEvents.decode(batch.encode()) == batch
    assert KvEvents.decode(KvEvents("p1", []).encode()) == KvEvents("p1", [])


def test_overlap_counts_the_leading_blocks_each_worker_holds() -> None:
    index = PrefixIndex()
    p0, p1 = worker_cache(), worker_cache()
    run_prefill(p0, make_request("a", list(range(13))))  # 3 full blocks
    run_prefill(p1, make_request("b", [*range(4), 70, 71, 72, 73, 74]))  # shares block 1 only
    publish(index, "p0", p0)
    publish(index, "p1", p1)
    prompt = list(prefix_hashes(list(range(20)), BS))
    assert index.overlap(prompt) == {"p0": 3, "p1": 1}
    assert index.overlap(list(prefix_hashes([9] * 8, BS))) == {}
    assert index.overlap([]) == {}


def test_evicted_blocks_leave_the_index_and_a_hole_ends_the_prefix() -> None:
    index = PrefixIndex()
    p0 = KVCacheManager(num_blocks=3, block_size=BS)
    p0.record_events()
    old = make_request("old", list(range(12)))  # 3 full blocks
    run_prefill(p0, old)
    p0.free(old)
    publish(index, "p0", p0)
    assert index.overlap(list(prefix_hashes(list(range(12)), BS))) == {"p0": 3}
    run_prefill(p0, make_request("new", [90, 91]))  # takes the LRU block: freed first, the last
    publish(index, "p0", p0)
    assert index.num_blocks("p0") == 2
    assert index.overlap(list(prefix_hashes(list(range(12)), BS))) == {"p0": 2}


def test_a_restarted_worker_starts_over_and_departed_workers_are_forgotten() -> None:
    index = PrefixIndex(grace_s=5.0)
    p0 = worker_cache()
    run_prefill(p0, make_request("a", list(range(9))))
    publish(index, "p0", p0)
    publish(index, "p1", worker_cache(), cleared=True)  # p1 started: empty
    assert index.num_blocks("p0") == 2
    publish(index, "p0", worker_cache(), cleared=True)  # p0 restarted with an empty cache
    assert index.overlap(list(prefix_hashes(list(range(9)), BS))) == {}
    run_prefill(p0 := worker_cache(), make_request("b", list(range(9))))
    publish(index, "p0", p0)
    index.retain({"p0"})  # p1 is gone from the registry, but heard from just now: kept
    assert index.num_blocks("p0") == 2
    index.retain(set(), now=time.monotonic() + 6)  # neither registered nor heard for 6 s
    assert index.overlap(list(prefix_hashes(list(range(9)), BS))) == {}
    assert index.num_blocks("p0") == 0


def test_a_worker_heard_only_starting_is_forgotten_once_gone() -> None:
    index = PrefixIndex(grace_s=5.0)
    publish(index, "p9", worker_cache(), cleared=True)  # started, then died before any event
    assert index.workers() == {"p9"}
    index.retain(set(), now=time.monotonic() + 6)
    assert index.workers() == set()


def test_a_stateful_workers_overlap_ends_at_its_last_snapshot() -> None:
    """DeepSeek-V4's workers serve a hit only up to a block whose end has a state snapshot:
    the index counts a stateful worker's blocks only that far, and follows the snapshots it
    keeps and drops; a stateless worker's count is its blocks."""
    hashes = list(prefix_hashes(list(range(20)), BS))  # 5 blocks
    index = PrefixIndex()
    v4 = KvEvents("v4", [(True, h) for h in hashes], True, [(True, hashes[1])], stateful=True)
    v3 = KvEvents("v3", [(True, h) for h in hashes[:3]], True)
    for batch in (v4, v3):
        index.apply(KvEvents.decode(batch.encode()))
    assert index.overlap(hashes) == {"v4": 2, "v3": 3}
    index.apply(KvEvents("v4", [], snapshots=[(True, hashes[3])], stateful=True))
    assert index.overlap(hashes)["v4"] == 4
    assert index.overlap(hashes[:3])["v4"] == 2  # a shorter prompt: its own last snapshot
    index.apply(
        KvEvents("v4", [], snapshots=[(False, hashes[1]), (False, hashes[3])], stateful=True)
    )
    assert index.overlap(hashes)["v4"] == 0
    batch = KvEvents("w", [(True, 5)], False, [(True, 7), (False, 9)], stateful=True)
    assert KvEvents.decode(batch.encode()) == batch
