"""DeepSeek-V4's lightning indexer in one Triton kernel: one program per query scores the entries
it may see, a chunk at a time, and keeps its best ones in registers.

Each (score, entry id) pair is packed into one int64 that orders as the score does (the float's
bits made monotonic, in the high half; the id in the low half), so that a single sort moves both.
The running best is a sorted (descending) list of CHUNK keys; a chunk of CHUNK new keys is sorted
ascending, and the elementwise max of the two lists is a bitonic sequence holding the CHUNK best
of both, which a bitonic merge sorts (log2 CHUNK compare-exchange steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, mma, next_pow2


@dataclass(frozen=True)
class IndexerBlocks:
    """``block_e`` entries scored per dot (all heads at once); the best list and the merged
    chunks hold ``max(next_pow2(k), block_e)`` keys. The defaults fit V4-Flash's indexer (64
    heads, dim 128, k 512) on sm_90 without spills (tests/kernels/sm90_compile_v4.py)."""

    block_e: int = 64
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _pack(score, entry):
    """(score float32, entry id int32 >= 0) -> int64 ordered as score, ties by id."""
    bits = score.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude's order
    return (key.to(tl.int64) << 32) | entry.to(tl.int64)


@triton.jit
def _indexer_topk_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    visible_ptr,
    out_ptr,
    num_heads,
    dim,
    num_entries,
    k,
    scale,
    q_stride_t,
    q_stride_h,
    w_stride_t,
    keys_stride_t,
    keys_stride_e,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Query pid(0), as indexer_topk_torch computes it.

    q: [n, heads, dim]; w: [n, heads] float32; keys: [entries, dim] (keys_stride_t = 0) or
    [n, entries, dim]; visible: [n] int. out: [n, k] int64 (contiguous), best first, -1 past the
    visible count. CHUNK: a power of two >= k and >= BLOCK_E.
    """
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim
    q = tl.load(
        q_ptr + t * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    w = tl.load(w_ptr + t * w_stride_t + heads, mask=h_mask, other=0.0).to(tl.float32)
    visible = tl.minimum(tl.load(visible_ptr + t).to(tl.int32), num_entries)
    keys_base = keys_ptr + t * keys_stride_t
    SUBS: tl.constexpr = CHUNK // BLOCK_E
    sub = tl.arange(0, SUBS)
    e_sub = tl.arange(0, BLOCK_E)

    best = _pack(tl.full([CHUNK], float("-inf"), tl.float32), tl.zeros([CHUNK], tl.int32))
    for e0 in range(0, visible, CHUNK):
        # Score the chunk BLOCK_E entries at a time, into row j of a [SUBS, BLOCK_E] tile.
        chunk = tl.zeros([SUBS, BLOCK_E], tl.int64)
        for j in range(SUBS):
            e = e0 + j * BLOCK_E + e_sub
            e_mask = e < visible
            kt = tl.load(
                keys_base + e.to(tl.int64)[:, None] * keys_stride_e + d[None, :],
                mask=e_mask[:, None] & d_mask[None, :],
                other=0.0,
            )  # [BLOCK_E, BLOCK_D]
            s = mma(q, tl.trans(kt), tl.zeros([BLOCK_H, BLOCK_E], tl.float32))
            total = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0) * scale  # [BLOCK_E]
            packed = _pack(tl.where(e_mask, total, float("-inf")), e)
            if SUBS == 1:
                chunk = packed[None, :]
            else:
                chunk = tl.where(sub[:, None] == j, packed[None, :], chunk)
        new = tl.sort(tl.reshape(chunk, [CHUNK]))  # ascending
        # Nothing in the chunk beats the current worst kept: skip the merge.
        if tl.max(new, axis=0) > tl.min(best, axis=0):
            best = tl.bitonic_merge(tl.maximum(best, new), descending=True)

    ranks = tl.arange(0, CHUNK)
    ids = tl.where(ranks < visible, best & 0xFFFFFFFF, -1)
    tl.store(out_ptr + t * k + ranks, ids, mask=ranks < k)


@register("indexer_topk", "triton")
def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    num_visible: torch.Tensor,
    k: int,
    *,
    blocks: IndexerBlocks | None = None,
) -> torch.Tensor:
    """q: [n, heads, dim]; weights: [n, heads] float32; keys: [entries, dim] (shared) or
    [n, entries, dim] (per query); num_visible: [n] int. Returns [n, k] int64 entry ids, best
    first, -1 where fewer than k are visible. See indexer_topk_torch."""
    blocks = blocks or IndexerBlocks()
    n, num_heads, dim = q.shape
    if keys.shape[-1] != dim or keys.dtype != q.dtype:
        raise TypeError(
            f"indexer_topk: q {tuple(q.shape)} {q.dtype} vs keys {tuple(keys.shape)} {keys.dtype}"
        )
    out = empty((n, k), torch.int64, q.device)
    if n == 0 or k == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.contiguous()
    num_visible = num_visible.contiguous()
    shared = keys.dim() == 2
    _indexer_topk_kernel[(n,)](
        q,
        weights,
        keys,
        num_visible,
        out,
        num_heads,
        dim,
        keys.shape[-2],
        k,
        dim**-0.5,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        0 if shared else keys.stride(0),
        keys.stride(-2),
        BLOCK_H=next_pow2(num_heads, at_least=16),  # tl.dot: M >= 16
        BLOCK_D=next_pow2(dim, at_least=16),
        BLOCK_E=blocks.block_e,
        CHUNK=max(next_pow2(k), blocks.block_e),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out
