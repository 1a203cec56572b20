"""Routed experts as grouped GEMMs over token choices sorted by expert.

The choices (token t, k-th pick) are sorted by slot and each slot's run is padded to a multiple of
``block_m`` (as vLLM's ``moe_align_block_size``), so that every row block of the sorted order
belongs to one slot. Then one grouped GEMM computes ``silu(x·gateᵀ) * (x·upᵀ)`` per choice, a
second multiplies by ``w2`` and the routing weight, and a last kernel sums each token's choices in
a fixed order (deterministic: no atomics on the output). Choices with slot -1 (experts on another
rank) are never sorted in and contribute nothing; slots no token chose get no blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, mma, next_pow2, to_dtype


@dataclass(frozen=True)
class MoEBlocks:
    """Tile sizes: ``block_m`` sorted choices x ``block_n`` outputs x ``block_k`` inputs per step;
    ``chunk`` choices per program while sorting."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    chunk: int = 128
    num_warps: int = 4
    num_stages: int = 3

    @staticmethod
    def default(num_choices: int, num_slots: int) -> MoEBlocks:
        """Row blocks about as tall as the choices on a slot, so that decode pads little. From
        ``python -m kernels.tune`` on an H100 at DeepSeek-V3's shapes
        (loadtest/results/kernel_tuning.json): with few choices per slot the weights' bytes
        dominate and every tiling ran within 5% of the fastest, so these keep the small tiles;
        with many, 128 outputs per program (and 8 warps for 128 rows) ran 1.2-1.4x faster."""
        block_m = min(128, next_pow2(triton.cdiv(num_choices, num_slots), at_least=16))
        if block_m <= 32:
            return MoEBlocks(block_m=block_m)
        return MoEBlocks(block_m=block_m, block_n=128, num_warps=8 if block_m == 128 else 4)


# ---- sorting the choices by slot --------------------------------------------------------------


@triton.jit
def _count_kernel(
    slots_ptr, counts_ptr, num_choices, num_slots, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr
):
    """counts[p, s] = how many choices of chunk p went to slot s.
    slots: [num_choices] int64 (-1: not on this rank); counts: [num_chunks, num_slots] int32."""
    p = tl.program_id(0)
    offs = p * CHUNK + tl.arange(0, CHUNK)
    slot = tl.load(slots_ptr + offs, mask=offs < num_choices, other=-1)
    valid = slot >= 0
    hist = tl.histogram(tl.where(valid, slot, 0).to(tl.int32), BLOCK_S, mask=valid)
    s = tl.arange(0, BLOCK_S)
    tl.store(counts_ptr + p * num_slots + s, hist, mask=s < num_slots)


@triton.jit
def _offsets_kernel(
    counts_ptr,
    slot_start_ptr,
    block_slot_ptr,
    num_chunks,
    num_slots,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program. Turns counts[p, s] into the number of slot-s choices in chunks before p (in
    place), writes slot_start[s] (first sorted row of slot s, runs padded to BLOCK_M) and
    block_slot[b] (the slot of sorted row block b, -1 past the last block)."""
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_slots
    total = tl.zeros([BLOCK_S], tl.int32)
    for p in range(num_chunks):
        row = counts_ptr + p * num_slots + s
        chunk_counts = tl.load(row, mask=s_mask, other=0)
        tl.store(row, total, mask=s_mask)
        total += chunk_counts
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded  # [BLOCK_S]
    tl.store(slot_start_ptr + s, start, mask=s_mask)
    num_rows = tl.sum(padded, axis=0)
    start = tl.where(s_mask, start, num_rows + 1)  # padding slots start after everything
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        row = b * BLOCK_M
        # starts never decrease, so the slot holding `row` is the last one starting at or before it
        slot = tl.sum((start[None, :] <= row[:, None]).to(tl.int32), axis=1) - 1
        tl.store(block_slot_ptr + b, tl.where(row < num_rows, slot, -1), mask=b < max_blocks)


@triton.jit
def _scatter_kernel(
    slots_ptr, counts_ptr, slot_start_ptr, sorted_ptr, num_choices, num_slots, CHUNK: tl.constexpr
):
    """sorted[slot_start[s] + (slot-s choices before this one)] = choice index, for each choice
    of chunk p; sorting is stable (choice order within a slot)."""
    p = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    offs = p * CHUNK + i
    slot = tl.load(slots_ptr + offs, mask=offs < num_choices, other=-1)
    valid = slot >= 0
    same_before = (slot[:, None] == slot[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)  # [CHUNK] earlier choices of this chunk
    safe = tl.where(valid, slot, 0)
    start = tl.load(slot_start_ptr + safe, mask=valid, other=0)
    before = tl.load(counts_ptr + p * num_slots + safe, mask=valid, other=0)
    tl.store(sorted_ptr + start + before + rank, offs, mask=valid)


# ---- the grouped GEMMs -----------------------------------------------------------------------


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    sorted_ptr,
    block_slot_ptr,
    num_choices,
    hidden,
    inter,
    x_stride,
    w_stride_s,
    w_stride_n,
    w_stride_k,
    act_stride,
    swiglu_limit,
    TOP_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """act[c, n] = silu(x[t]·gate[s, n]) * (x[t]·up[s, n]) (gate <= L, |up| <= L if HAS_LIMIT) for the BLOCK_M sorted choices
    c = t * TOP_K + k of row block pid(0), all on slot s, and BLOCK_N columns n.
    x: [tokens, hidden]; w13: [slots, 2 * inter, hidden] (gate rows, then up rows);
    act: [num_choices, inter], rows of padding or of other ranks' choices untouched."""
    slot = tl.load(block_slot_ptr + tl.program_id(0))
    if slot < 0:
        return
    rows = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_choices
    tokens = (rows // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * x_stride + k[None, :]  # [BLOCK_M, BLOCK_K]
    gate_ptrs = (
        w13_ptr
        + slot.to(tl.int64) * w_stride_s
        + n[None, :].to(tl.int64) * w_stride_n
        + k[:, None] * w_stride_k
    )  # [BLOCK_K, BLOCK_N]
    up_offset = inter * w_stride_n
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = k < hidden - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = mma(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate)
        up = mma(x, tl.load(gate_ptrs + up_offset, mask=w_mask, other=0.0), up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * w_stride_k
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    act = gate * tl.sigmoid(gate) * up
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * act_stride + n[None, :]
    tl.store(
        act_ptrs, to_dtype(act, act_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :]
    )


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    weights_ptr,
    y_ptr,
    sorted_ptr,
    block_slot_ptr,
    num_choices,
    hidden,
    inter,
    act_stride,
    w_stride_s,
    w_stride_n,
    w_stride_k,
    y_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[c, n] = weights[c] * (act[c]·w2[s, n]) for the sorted choices c of row block pid(0).
    act: [num_choices, inter]; w2: [slots, hidden, inter]; weights: [num_choices] float32;
    y: [num_choices, hidden]."""
    slot = tl.load(block_slot_ptr + tl.program_id(0))
    if slot < 0:
        return
    rows = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_choices
    rows = rows.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    k = tl.arange(0, BLOCK_K)
    act_ptrs = act_ptr + rows[:, None] * act_stride + k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = (
        w2_ptr
        + slot.to(tl.int64) * w_stride_s
        + n[None, :].to(tl.int64) * w_stride_n
        + k[:, None] * w_stride_k
    )  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = k < inter - k0
        a = tl.load(act_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = mma(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), acc)
        act_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    acc *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    y_ptrs = y_ptr + rows[:, None] * y_stride + n[None, :]
    tl.store(
        y_ptrs, to_dtype(acc, y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :]
    )


@triton.jit
def _sum_choices_kernel(
    y_ptr,
    slots_ptr,
    out_ptr,
    hidden,
    y_stride,
    out_stride,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t, cols] = sum over k (in order) of y[t * TOP_K + k, cols], skipping slot -1.
    y: [tokens * TOP_K, hidden]; slots: [tokens * TOP_K]; out: [tokens, hidden]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        if tl.load(slots_ptr + t * TOP_K + k) >= 0:
            y = tl.load(y_ptr + (t * TOP_K + k) * y_stride + cols, mask=mask, other=0.0)
            acc += y.to(tl.float32)
    tl.store(out_ptr + t * out_stride + cols, to_dtype(acc, out_ptr.dtype.element_ty), mask=mask)


# ---- host side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SortedChoices:
    """Choices sorted by slot: ``sorted_ids`` [max_blocks * block_m] choice indices (padding:
    num_choices) and ``block_slot`` [max_blocks] the slot of each row block (-1: unused)."""

    sorted_ids: torch.Tensor
    block_slot: torch.Tensor


def sort_by_slot(slots: torch.Tensor, num_slots: int, blocks: MoEBlocks) -> SortedChoices:
    """slots: [num_choices] int64, -1 for choices handled elsewhere. No host sync: the grid is
    sized for the worst case, ``cdiv(num_choices, block_m) + num_slots`` row blocks."""
    n, dev = slots.numel(), slots.device
    num_chunks = triton.cdiv(n, blocks.chunk)
    max_blocks = triton.cdiv(n, blocks.block_m) + min(num_slots, n)
    block_s = next_pow2(num_slots)
    counts = empty((num_chunks, num_slots), torch.int32, dev)
    slot_start = empty((num_slots,), torch.int32, dev)
    block_slot = empty((max_blocks,), torch.int32, dev)
    sorted_ids = torch.full((max_blocks * blocks.block_m,), n, dtype=torch.int32, device=dev)
    _count_kernel[(num_chunks,)](slots, counts, n, num_slots, CHUNK=blocks.chunk, BLOCK_S=block_s)
    _offsets_kernel[(1,)](
        counts,
        slot_start,
        block_slot,
        num_chunks,
        num_slots,
        max_blocks,
        BLOCK_M=blocks.block_m,
        BLOCK_S=block_s,
        BLOCK_B=64,
    )
    _scatter_kernel[(num_chunks,)](
        slots, counts, slot_start, sorted_ids, n, num_slots, CHUNK=blocks.chunk
    )
    return SortedChoices(sorted_ids, block_slot)


@register("fused_moe", "triton")
def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_slots: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    blocks: MoEBlocks | None = None,
) -> torch.Tensor:
    """hidden: [num_tokens, hidden]; w13: [num_slots, 2 * inter, hidden]; w2: [num_slots, hidden,
    inter]; topk_weights: [num_tokens, top_k] float32; topk_slots: [num_tokens, top_k] int64
    (-1: not on this rank). Returns [num_tokens, hidden]. See fused_moe_torch."""
    num_tokens, top_k = topk_slots.shape
    num_slots = w13.shape[0]
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(f"fused_moe: hidden is {hidden.dtype} but w13/w2 {w13.dtype}/{w2.dtype}")
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()  # the weights: any strides
    slots = topk_slots.reshape(-1).contiguous()  # [num_choices]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    blocks = blocks or MoEBlocks.default(slots.numel(), num_slots)
    order = sort_by_slot(slots, num_slots, blocks)
    act = _gate_up(x, w13, order, top_k, blocks, swiglu_limit)  # [num_choices, inter]
    y = _down(act, w2, weights, order, blocks)  # [num_choices, hidden]
    return _sum_choices(y, slots, num_tokens, top_k)


def _gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    order: SortedChoices,
    top_k: int,
    blocks: MoEBlocks,
    swiglu_limit: float | None,
) -> torch.Tensor:
    num_choices, hidden, inter = x.shape[0] * top_k, x.shape[1], w13.shape[1] // 2
    act = empty((num_choices, inter), x.dtype, x.device)
    grid = (order.block_slot.numel(), triton.cdiv(inter, blocks.block_n))
    _gate_up_kernel[grid](
        x,
        w13,
        act,
        order.sorted_ids,
        order.block_slot,
        num_choices,
        hidden,
        inter,
        x.stride(0),
        *w13.stride(),
        act.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit),
        TOP_K=top_k,
        HAS_LIMIT=swiglu_limit is not None,
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return act


def _down(
    act: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    order: SortedChoices,
    blocks: MoEBlocks,
) -> torch.Tensor:
    (num_choices, inter), hidden = act.shape, w2.shape[1]
    y = empty((num_choices, hidden), act.dtype, act.device)
    grid = (order.block_slot.numel(), triton.cdiv(hidden, blocks.block_n))
    _down_kernel[grid](
        act,
        w2,
        weights,
        y,
        order.sorted_ids,
        order.block_slot,
        num_choices,
        hidden,
        inter,
        act.stride(0),
        *w2.stride(),
        y.stride(0),
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return y


def _sum_choices(y: torch.Tensor, slots: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    hidden = y.shape[1]
    out = empty((num_tokens, hidden), y.dtype, y.device)
    block = min(1024, next_pow2(hidden))
    _sum_choices_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, slots, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block
    )
    return out
