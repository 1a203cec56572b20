"""Causal flash attention for a chunk of new tokens over their whole context (the prefill path)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, mma, next_pow2, to_dtype


@dataclass(frozen=True)
class PrefillBlocks:
    """``block_m`` queries per program x ``block_n`` keys per step. The defaults are the fastest
    of ``python -m kernels.tune`` on an H100 at DeepSeek-V3's shapes
    (loadtest/results/kernel_tuning.json)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    q_len,
    ctx_len,
    qk_dim,
    v_dim,
    scale_log2,
    q_stride_h,
    q_stride_t,
    k_stride_h,
    k_stride_t,
    v_stride_h,
    v_stride_t,
    out_stride_t,
    out_stride_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Queries block pid(0) of head pid(1), as prefill_attention_torch computes it.

    q: [heads, q_len, qk_dim]; k: [heads, ctx_len, qk_dim]; v: [heads, ctx_len, v_dim] (any
    strides but the last); query i sits at position ctx_len - q_len + i and sees keys 0..that.
    out: [q_len, heads, v_dim].
    """
    h = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < q_len
    pos = ctx_len - q_len + i  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_mask, dv_mask = d < qk_dim, dv < v_dim
    rows = i.to(tl.int64)[:, None]  # 64-bit offsets: long contexts pass 2^31 elements
    q = tl.load(
        q_ptr + h * q_stride_h + rows * q_stride_t + d[None, :],
        mask=i_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    last_key = tl.minimum(ctx_len, ctx_len - q_len + (tl.program_id(0) + 1) * BLOCK_M)
    for n0 in range(0, last_key, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < ctx_len
        keys = n.to(tl.int64)[:, None]
        k = tl.load(
            k_ptr + h * k_stride_h + keys * k_stride_t + d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32)) * scale_log2
        s = tl.where((n[None, :] <= pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(probs, axis=1)
        v = tl.load(
            v_ptr + h * v_stride_h + keys * v_stride_t + dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        acc = mma(to_dtype(probs, v.dtype), v, acc * alpha[:, None])
        m = m_new
    out = out_ptr + rows * out_stride_t + h * out_stride_h + dv[None, :]
    tl.store(
        out,
        to_dtype(acc / denom[:, None], out_ptr.dtype.element_ty),
        mask=i_mask[:, None] & dv_mask[None, :],
    )


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@register("prefill_attention", "triton")
def prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    *,
    blocks: PrefillBlocks | None = None,
) -> torch.Tensor:
    """q: [heads, q_len, qk_dim]; k: [heads, ctx_len, qk_dim]; v: [heads, ctx_len, v_dim].
    Returns [q_len, heads, v_dim]. See prefill_attention_torch."""
    blocks = blocks or PrefillBlocks()
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    heads, q_len, qk_dim = q.shape
    ctx_len, v_dim = k.shape[1], v.shape[2]
    out = empty((q_len, heads, v_dim), q.dtype, q.device)
    if q_len == 0:
        return out
    _prefill_kernel[(triton.cdiv(q_len, blocks.block_m), heads)](
        q,
        k,
        v,
        out,
        q_len,
        ctx_len,
        qk_dim,
        v_dim,
        softmax_scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_D=next_pow2(qk_dim, at_least=16),
        BLOCK_DV=next_pow2(v_dim, at_least=16),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out
