from __future__ import annotations

import pytest

from ferry.services.common.cluster_state import LoadReport, WorkerRecord
from ferry.services.scheduler.policies import POLICIES, Candidate, RouteRequest, create_policy

REQ = RouteRequest("r", num_prompt_tokens=100, num_blocks=7)


def cand(wid: str, role: str, **load: int) -> Candidate:
    routed = {
        k: load.pop(k) for k in ("routed_requests", "routed_tokens", "routed_blocks") if k in load
    }
    return Candidate(WorkerRecord(wid, role, "127.0.0.1:1"), LoadReport(**load), **routed)


def test_registry_names_both_policies_and_rejects_others() -> None:
    assert {"kv_aware", "least_loaded", "round_robin"} <= set(POLICIES)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        create_policy("fastest")


def test_least_loaded_prefill_takes_fewest_queued_tokens_counting_routed_ones() -> None:
    policy = create_policy("least_loaded")
    a = cand("a", "prefill", queued_prefill_tokens=500)
    b = cand("b", "prefill", queued_prefill_tokens=100)
    assert policy.pick_prefill([a, b], REQ).worker_id == "b"
    # what this scheduler sent to b since its report counts too
    b = cand("b", "prefill", queued_prefill_tokens=100, routed_tokens=600, routed_requests=3)
    assert policy.pick_prefill([a, b], REQ).worker_id == "a"


def test_least_loaded_decode_takes_most_free_blocks_then_fewest_running() -> None:
    policy = create_policy("least_loaded")
    a = cand("a", "decode", free_kv_blocks=50, running=1)
    b = cand("b", "decode", free_kv_blocks=90, running=9)
    assert policy.pick_decode([a, b], REQ).worker_id == "b"
    b = cand("b", "decode", free_kv_blocks=90, running=9, routed_blocks=40)
    assert policy.pick_decode([a, b], REQ).worker_id == "a"
    c = cand("c", "decode", free_kv_blocks=50, running=0)
    assert policy.pick_decode([a, c], REQ).worker_id == "c"


def test_least_loaded_ties_go_to_the_lower_worker_id() -> None:
    policy = create_policy("least_loaded")
    ws = [cand(w, "decode", free_kv_blocks=10) for w in ("d2", "d0", "d1")]
    assert policy.pick_decode(ws, REQ).worker_id == "d0"


def test_round_robin_cycles_per_role_in_worker_id_order() -> None:
    policy = create_policy("round_robin")
    ps = [cand(w, "prefill") for w in ("p1", "p0")]
    ds = [cand(w, "decode", free_kv_blocks=99 if w == "d0" else 0) for w in ("d0", "d1", "d2")]
    assert [policy.pick_prefill(ps, REQ).worker_id for _ in range(4)] == ["p0", "p1"] * 2
    assert [policy.pick_decode(ds, REQ).worker_id for _ in range(4)] == ["d0", "d1", "d2", "d0"]


def test_aggregated_workers_are_picked_by_requests_then_queued_tokens_then_room() -> None:
    least = create_policy("least_loaded")
    a = cand("a", "aggregated", running=3, free_kv_blocks=90)
    b = cand("b", "aggregated", running=1, queued_prefill_tokens=800, free_kv_blocks=10)
    assert least.pick_aggregated([a, b], REQ).worker_id == "b"
    c = cand("c", "aggregated", running=1, queued_prefill_tokens=100, free_kv_blocks=10)
    assert least.pick_aggregated([b, c], REQ).worker_id == "c"
    d = cand("d", "aggregated", running=1, queued_prefill_tokens=100, free_kv_blocks=50)
    assert least.pick_aggregated([c, d], REQ).worker_id == "d"
    rr = create_policy("round_robin")
    ws = [cand(w, "aggregated") for w in ("g1", "g0")]
    assert [rr.pick_aggregated(ws, REQ).worker_id for _ in range(3)] == ["g0", "g1", "g0"]


def test_kv_aware_prefill_weighs_cached_prefix_against_queued_tokens() -> None:
    policy = create_policy("kv_aware")
    req = RouteRequest("r", num_prompt_tokens=1000, num_blocks=63, block_size=16)
    hit = cand("p1", "prefill", queued_prefill_tokens=300)
    hit = Candidate(hit.record, hit.load, cached_blocks=50)  # 800 of its 1000 tokens
    idle = cand("p0", "prefill")
    assert policy.pick_prefill([idle, hit], req).worker_id == "p1"  # 300 + 200 < 0 + 1000
    busy = Candidate(hit.record, LoadReport(queued_prefill_tokens=900), cached_blocks=50)
    assert policy.pick_prefill([idle, busy], req).worker_id == "p0"  # 900 + 200 > 1000
    # nothing cached anywhere: as least_loaded, ties to the lower id
    ws = [cand(w, "prefill") for w in ("p2", "p0", "p1")]
    assert policy.pick_prefill(ws, req).worker_id == "p0"
    assert policy.pick_decode(ws, req).worker_id == "p0"


def test_kv_aware_aggregated_counts_blocks_to_compute_plus_blocks_held() -> None:
    policy = create_policy("kv_aware")
    req = RouteRequest("r", num_prompt_tokens=160, num_blocks=10, block_size=16)
    a = cand("a", "aggregated", total_kv_blocks=100, free_kv_blocks=95)  # 5 + 10
    b = cand("b", "aggregated", total_kv_blocks=100, free_kv_blocks=90)
    b = Candidate(b.record, b.load, cached_blocks=9)  # 10 + 1
    assert policy.pick_aggregated([a, b], req).worker_id == "b"
    assert policy.uses_prefixes and not create_policy("least_loaded").uses_prefixes
