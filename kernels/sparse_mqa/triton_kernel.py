"""DeepSeek-V4's sparse attention in one Triton kernel: one program per (query, block of heads)
gathers the key rows its query's indices name, tile by tile, and runs an online softmax over
them that starts from the heads' sink logits (so the sink's weight needs no extra pass and a
query with no index ends at 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, mma, next_pow2, to_dtype


@dataclass(frozen=True)
class SparseBlocks:
    """``block_h`` heads (at most: fewer heads, a smaller block) x ``block_k`` gathered rows per
    step. At V4-Flash's 64 heads of dim 512 the defaults build for sm_90 without spills
    (tests/kernels/sm90_compile_v4.py); 64 heads x 32 rows, one program per query, spill 120
    bytes per thread. Not yet measured on a GPU."""

    block_h: int = 32
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _sparse_mqa_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sinks_ptr,
    out_ptr,
    num_heads,
    dim,
    num_indices,
    scale_log2,
    q_stride_t,
    q_stride_h,
    kv_stride,
    idx_stride,
    out_stride_t,
    out_stride_h,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Heads block pid % head_blocks of query pid // head_blocks, as sparse_mqa_torch computes
    it: a query's head blocks run side by side, so its gathered rows are read from L2 after the
    first.

    q: [num_queries, heads, dim]; kv: [num_rows, dim]; idx: [num_queries, num_indices] int32 or
    int64 (-1: no row); sinks: [heads] float32; out: [num_queries, heads, dim] (q's dtype).
    Scores are kept in log2 units: the softmax is exp2(s · scale · log2 e).
    """
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    t = (tl.program_id(0) // head_blocks).to(tl.int64)
    heads = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim
    q = tl.load(
        q_ptr + t * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    # The sink is the softmax's first column: m starts at it, with denom = 2^0 and no value.
    m = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    denom = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(0, num_indices, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        row = tl.load(idx_ptr + t * idx_stride + k, mask=k < num_indices, other=-1).to(tl.int64)
        valid = row >= 0
        rows = tl.load(
            kv_ptr + row[:, None] * kv_stride + d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_D]
        s = mma(q, tl.trans(rows), tl.zeros([BLOCK_H, BLOCK_K], tl.float32)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(probs, axis=1)
        acc = mma(to_dtype(probs, rows.dtype), rows, acc * alpha[:, None])
        m = m_new
    out = out_ptr + t * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
    tl.store(
        out,
        to_dtype(acc / denom[:, None], out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@register("sparse_mqa", "triton")
def sparse_mqa_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    *,
    blocks: SparseBlocks | None = None,
) -> torch.Tensor:
    """q: [num_queries, heads, dim]; kv: [num_rows, dim]; indices: [num_queries, k] int32 or
    int64, -1 for none; sinks: [heads] float32. Returns [num_queries, heads, dim] in q's dtype.
    See sparse_mqa_torch."""
    blocks = blocks or SparseBlocks()
    num_queries, num_heads, dim = q.shape
    if kv.shape[-1] != dim or kv.dtype != q.dtype:
        raise TypeError(
            f"sparse_mqa: q {tuple(q.shape)} {q.dtype} vs kv {tuple(kv.shape)} {kv.dtype}"
        )
    out = empty((num_queries, num_heads, dim), q.dtype, q.device)
    if num_queries == 0:
        return out
    q, kv, indices = _last_contiguous(q), _last_contiguous(kv), _last_contiguous(indices)
    sinks = sinks.contiguous()
    block_h = min(blocks.block_h, next_pow2(num_heads, at_least=16))  # tl.dot: M >= 16
    _sparse_mqa_kernel[(num_queries * triton.cdiv(num_heads, block_h),)](
        q,
        kv,
        indices,
        sinks,
        out,
        num_heads,
        dim,
        indices.shape[1],
        softmax_scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=block_h,
        BLOCK_K=blocks.block_k,
        BLOCK_D=next_pow2(dim, at_least=16),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out
