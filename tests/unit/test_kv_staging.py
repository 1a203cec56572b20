"""How a transfer is cut into messages, and the checksum that does not depend on it."""

from __future__ import annotations

import pytest
import torch

from ferry.services.kv_transfer.staging import (
    DIRECT_MIN_RUN_BYTES,
    TransferPlan,
    block_rows,
    block_runs,
    checksum,
    checksum_blocks,
    gather_blocks,
    gather_rows,
    row_order,
    runs_of,
    scatter_rows,
)

# one block of one layer is a sixteenth of the threshold: 16 consecutive blocks make a run
BLOCK_BYTES = DIRECT_MIN_RUN_BYTES // 16


def test_block_runs_and_back() -> None:
    ids = [5, 6, 7, 2, 9, 10]
    assert block_runs(ids) == [(0, 3), (3, 1), (4, 2)]
    assert runs_of([(ids[off], n) for off, n in block_runs(ids)]) == ids
    assert block_runs([]) == []


def test_both_sides_fragmented_is_staged() -> None:
    src = list(range(0, 64, 2))
    dst = list(range(1, 65, 2))
    assert TransferPlan.make(src, dst, BLOCK_BYTES) is None


def test_plan_cuts_at_the_breaks_of_each_in_place_side() -> None:
    src = list(range(100, 132))  # one run: in place
    dst = list(range(0, 16)) + list(range(40, 56))  # two runs of 16: in place
    plan = TransferPlan.make(src, dst, BLOCK_BYTES)
    assert plan == TransferPlan([(0, 16), (16, 16)], src_in_place=True, dst_in_place=True)
    assert TransferPlan.from_json(plan.to_json()) == plan


def test_fragmented_side_stages_and_does_not_cut() -> None:
    src = list(range(32))
    dst = list(range(64, 0, -2))  # every block its own run: staged
    plan = TransferPlan.make(src, dst, BLOCK_BYTES)
    assert plan == TransferPlan([(0, 32)], src_in_place=True, dst_in_place=False)
    assert TransferPlan.make(dst, src, BLOCK_BYTES) == TransferPlan(
        [(0, 32)], src_in_place=False, dst_in_place=True
    )


def test_plan_refuses_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 source blocks for 1 destination blocks"):
        TransferPlan.make([1, 2], [3], BLOCK_BYTES)


def test_checksum_of_blocks_equals_checksum_of_the_gathered_payload() -> None:
    cache = torch.randn(3, 20, 4, 8, dtype=torch.bfloat16)
    ids = [7, 8, 9, 0, 15, 3, 4]
    assert checksum_blocks(cache, ids) == checksum(gather_blocks(cache, ids))


def test_rows_gather_in_transfer_order_and_scatter_exactly() -> None:
    src = torch.randn(3, 20, 4, 8, dtype=torch.bfloat16)
    src[1, 8, 0, 0] = float("nan")
    ids = [7, 8, 9, 0, 15, 3, 4]
    rows = torch.empty(3 * len(ids), 4 * 8 * 2, dtype=torch.uint8)
    gather_rows(block_rows(src), row_order(ids, 3, 20), rows)
    payload = rows.view(torch.bfloat16).view(3, len(ids), 4, 8)
    assert checksum(payload) == checksum(gather_blocks(src, ids))  # the same bytes, NaN included
    dst = torch.zeros_like(src)
    dst_ids = [19, 2, 11, 12, 13, 5, 6]
    order = row_order(dst_ids, 3, 20)
    scatter_rows(block_rows(dst), order[:9], rows[:9])  # in two chunks, split mid-layer
    scatter_rows(block_rows(dst), order[9:], rows[9:])
    assert checksum_blocks(dst, dst_ids) == checksum_blocks(src, ids)
    assert not dst[:, [b for b in range(20) if b not in dst_ids]].any()


def test_row_order_refuses_blocks_outside_the_cache() -> None:
    assert row_order([2, 0], 2, 3).tolist() == [2, 0, 5, 3]
    with pytest.raises(ValueError, match="outside a cache of 20 blocks"):
        row_order([3, 20], 2, 20)
