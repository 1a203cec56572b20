"""fused_moe: Triton (interpreted) against the torch reference, and the sort by slot it uses."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.fused_moe.triton_kernel import MoEBlocks, sort_by_slot
from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton

SMALL = MoEBlocks(block_m=16, block_n=16, block_k=16, chunk=8)  # several tiles on tiny shapes

# (num_tokens, hidden, inter, num_slots, top_k, dtype)
CASES = [
    (10, 24, 8, 6, 3, torch.float32),
    (7, 40, 24, 9, 2, torch.bfloat16),
    (33, 48, 20, 4, 2, torch.float32),  # several row blocks per slot
    (3, 16, 16, 5, 1, torch.float32),  # top_k 1: how the expert-parallel path calls it
]


def _inputs(
    tokens: int, hidden: int, inter: int, slots: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Slots drawn from -1 (another rank's) .. slots - 3, so the last two slots get nobody."""
    gen = generator(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=gen) * 0.2).to(dtype)
    topk_slots = torch.randint(-1, slots - 2, (tokens, top_k), generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    return x, w13, w2, weights, topk_slots


@pytest.mark.parametrize("blocks", [SMALL, None], ids=["small_blocks", "default_blocks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-S{c[3]}-k{c[4]}")
def test_fused_moe(case: tuple[int, int, int, int, int, torch.dtype], blocks: MoEBlocks) -> None:
    args = _inputs(*case)
    out = triton("fused_moe", *args, blocks=blocks)
    assert_matches(out, torch_ref("fused_moe", *args), case[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_swiglu_limit(dtype: torch.dtype) -> None:
    """DeepSeek-V4's clamp: large weights push gate and up past the limit."""
    x, w13, w2, weights, slots = _inputs(12, 32, 16, 5, 3, dtype)
    w13 = w13 * 20
    out = triton("fused_moe", x, w13, w2, weights, slots, 1.5, blocks=SMALL)
    ref = torch_ref("fused_moe", x, w13, w2, weights, slots, 1.5)
    assert_matches(out, ref, dtype)
    assert not torch.allclose(ref, torch_ref("fused_moe", x, w13, w2, weights, slots))


def test_every_choice_elsewhere_gives_zeros() -> None:
    x, w13, w2, weights, slots = _inputs(5, 16, 16, 3, 2, torch.float32)
    out = triton("fused_moe", x, w13, w2, weights, torch.full_like(slots, -1), blocks=SMALL)
    assert torch.equal(out, torch.zeros_like(x))


def test_no_tokens() -> None:
    x, w13, w2, weights, slots = _inputs(4, 16, 16, 3, 2, torch.float32)
    assert triton("fused_moe", x[:0], w13, w2, weights[:0], slots[:0]).shape == (0, 16)


def test_sort_by_slot_groups_and_pads() -> None:
    """Each row block holds one slot's choices (then padding); every choice on this rank appears
    once, in order within its slot; -1 choices and empty slots get no rows."""
    slots = torch.randint(-1, 5, (45,), generator=generator(9))  # 7 slots: 5 and 6 empty
    order = sort_by_slot(slots, 7, SMALL)
    rows = order.sorted_ids.view(-1, SMALL.block_m)  # [max_blocks, block_m]
    seen = []
    for block, slot in enumerate(order.block_slot.tolist()):
        real = rows[block][rows[block] < slots.numel()].tolist()
        if slot < 0:
            assert not real
            continue
        assert real and all(int(slots[c]) == slot for c in real)
        seen += real
    expect = [c for s in range(7) for c in range(45) if int(slots[c]) == s]
    assert seen == expect
