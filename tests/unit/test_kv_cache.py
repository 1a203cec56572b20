"""KVCacheManager: reference counts, prefix hits, LRU eviction, integrity."""

from __future__ import annotations

import pytest

from ferry.services.common.prefix_hash import hash_block, prefix_hashes
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.engine.request import Request
from tests.helpers import make_request


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    """What the engine does for a request's prompt: prefix match, allocate, compute, commit."""
    cached = kv.match_prefix(req)
    num_cached = len(cached[0]) * kv.block_size
    assert kv.allocate(req, req.num_tokens - num_cached, cached)
    req.num_computed_tokens = req.num_tokens
    kv.commit(req)


def test_hash_chains_on_parent_and_salt() -> None:
    a = hash_block(0, [1, 2, 3], b"m1")
    assert a == hash_block(0, [1, 2, 3], b"m1")
    assert a != hash_block(0, [1, 2, 3], b"m2")
    assert hash_block(a, [4], b"m1") != hash_block(0, [4], b"m1")


def test_shared_prefix_reuses_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    run_prefill(kv, a)
    b = make_request("b", [*range(8), 99, 98, 97])
    blocks, _ = kv.match_prefix(b)
    assert blocks == a.block_ids[:2]
    run_prefill(kv, b)
    assert kv.pool.ref_count[a.block_ids[0]] == 2
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    usage = kv.usage()
    assert usage["in_use"] == 0 and usage["cached"] >= 2


def test_full_prompt_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    blocks, _ = kv.match_prefix(make_request("b", list(range(8))))
    assert len(blocks) == 1  # the second block holds the last token, whose logits we need


def test_lru_eviction_and_refusal() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old = make_request("old", list(range(8)))
    run_prefill(kv, old)
    kv.free(old)
    assert kv.usage()["cached"] == 2
    big = make_request("big", [50 + i for i in range(16)])
    run_prefill(kv, big)  # needs all four blocks: evicts both cached ones
    assert kv.match_prefix(make_request("again", list(range(9))))[0] == []
    assert not kv.allocate(make_request("x", [1]), 1)  # nothing left; refusal changes nothing
    kv.check_integrity([big])


def test_integrity_catches_a_leak() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", [1, 2, 3])
    run_prefill(kv, a)
    with pytest.raises(AssertionError, match="ref_count 1, held 0 times"):
        kv.check_integrity([])  # a still holds its block but is not listed as live


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.match_prefix(make_request("b", list(range(9)))) == ([], [])
    kv.free(a)
    assert kv.usage()["cached"] == 0


def test_kv_events_name_every_hash_stored_and_evicted_in_order() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, salt=b"model")
    assert kv.take_events() == []  # nobody asked: nothing is kept
    kv.record_events()
    old = make_request("old", list(range(9)))  # 2 full blocks + 1 token
    run_prefill(kv, old)
    stored = list(prefix_hashes(list(range(9)), 4, b"model"))
    assert len(stored) == 2
    assert kv.take_events() == [(True, h) for h in stored]
    assert kv.take_events() == []  # taken
    kv.free(old)
    assert kv.take_events() == []  # freed blocks stay cached: still findable
    big = make_request("big", [50 + i for i in range(16)])
    run_prefill(kv, big)  # needs all four blocks: evicts both cached ones
    events = kv.take_events()
    # freed tail first, so evicted tail first
    assert [e for e in events if not e[0]] == [(False, stored[1]), (False, stored[0])]
    assert [h for s, h in events if s] == list(prefix_hashes(big.prompt_token_ids, 4, b"model"))
    snapshot = kv.take_events(snapshot=True)
    assert sorted(snapshot) == sorted((True, h) for h in kv.pool.hash_to_block)
    assert kv.take_events() == []


def test_prefix_hashes_are_what_the_cache_matches() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, salt=b"")
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    _, hashes = kv.match_prefix(make_request("b", list(range(12))))
    assert hashes == list(prefix_hashes(list(range(11)), 4, b""))  # not the last token's block
