"""Absorbed MLA decode over the paged latent cache, split-K ("flash decoding") in two kernels.

Every query attends to its request's cached ``c_kv ‖ k_rope`` latents (MQA: one latent per
token, shared by all heads). The first kernel runs one program per (block of heads, request,
split): an online softmax over its split of the context, written as a partial (max, sum,
unnormalised accumulator). The second merges a request's splits. The number of splits is chosen
from the block table's width, so no host sync on ``seq_lens`` is needed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, mma, next_pow2, to_dtype


@dataclass(frozen=True)
class DecodeBlocks:
    """``block_h`` heads (at most: fewer heads, a smaller block) x ``block_n`` context tokens per
    step; ``num_splits`` splits of each request's context (None: enough to fill the GPU). The
    defaults are the fastest of ``python -m kernels.tune`` on an H100 at DeepSeek-V3's shapes
    (loadtest/results/kernel_tuning.json): 64 heads share each latent read, 2.3-2.5 times
    faster than 16."""

    block_h: int = 64
    block_n: int = 64
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _split_kernel(
    q_ptr,
    kv_ptr,
    tables_ptr,
    lens_ptr,
    m_ptr,
    denom_ptr,
    acc_ptr,
    num_heads,
    kv_lora_rank,
    rope_dim,
    block_size,
    scale_log2,
    q_stride_b,
    q_stride_h,
    kv_stride_block,
    kv_stride_token,
    table_stride,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Heads block pid(0) of request pid(1) over split pid(2) of its context.

    q: [batch, heads, rank + rope]; kv: [num_blocks, block_size, rank + rope];
    tables: [batch, max_blocks] int (-1 past the end); lens: [batch] int (>= 1).
    Writes m, denom: [batch, heads, NUM_SPLITS] float32 (the running max of the scores, in log2
    units, and Σ 2^(s - m)) and acc: [batch, heads, NUM_SPLITS, rank] float32 (Σ 2^(s - m) · c_kv);
    a split with no tokens writes m = -inf, denom = 0, acc = 0.
    """
    b = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_mask, p_mask = r < kv_lora_rank, p < rope_dim

    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    q_rows = q_ptr + b.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h
    q_lat = tl.load(q_rows + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_rope = tl.load(
        q_rows + kv_lora_rank + p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(
            tables_ptr + b.to(tl.int64) * table_stride + n // block_size, mask=n_mask, other=0
        ).to(tl.int64)
        token = kv_ptr + page * kv_stride_block + (n % block_size) * kv_stride_token  # [BLOCK_N]
        lat = tl.load(
            token[:, None] + r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]
        rope = tl.load(
            token[:, None] + kv_lora_rank + p[None, :],
            mask=n_mask[:, None] & p_mask[None, :],
            other=0.0,
        )
        s = mma(q_lat, tl.trans(lat), tl.zeros([BLOCK_H, BLOCK_N], tl.float32))
        s = mma(q_rope, tl.trans(rope), s) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(probs, axis=1)
        acc = mma(to_dtype(probs, lat.dtype), lat, acc * alpha[:, None])
        m = m_new

    row = (b * num_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(m_ptr + row, m, mask=h_mask)
    tl.store(denom_ptr + row, denom, mask=h_mask)
    tl.store(
        acc_ptr + row[:, None] * kv_lora_rank + r[None, :],
        acc,
        mask=h_mask[:, None] & r_mask[None, :],
    )


@triton.jit
def _merge_kernel(
    m_ptr,
    denom_ptr,
    acc_ptr,
    out_ptr,
    num_heads,
    kv_lora_rank,
    out_stride_b,
    out_stride_h,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[b, h] = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) denom_s, M = max_s m_s, for head
    pid(0) of request pid(1). Inputs as _split_kernel writes them; out: [batch, heads, rank]."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    row0 = (b * num_heads + h).to(tl.int64) * NUM_SPLITS
    s = tl.arange(0, BLOCK_S)
    m_max = tl.max(tl.load(m_ptr + row0 + s, mask=s < NUM_SPLITS, other=float("-inf")), axis=0)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < kv_lora_rank
    acc = tl.zeros([BLOCK_R], tl.float32)
    total = 0.0
    for split in range(NUM_SPLITS):
        w = tl.exp2(tl.load(m_ptr + row0 + split) - m_max)  # 0 for an empty split
        total += w * tl.load(denom_ptr + row0 + split)
        acc += w * tl.load(acc_ptr + (row0 + split) * kv_lora_rank + r, mask=r_mask, other=0.0)
    out = out_ptr + b.to(tl.int64) * out_stride_b + h * out_stride_h + r
    tl.store(out, to_dtype(acc / total, out_ptr.dtype.element_ty), mask=r_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _num_splits(programs: int, max_tokens: int, blocks: DecodeBlocks, device: torch.device) -> int:
    """Enough splits for ~2 programs per SM, each split at least 4 token tiles long."""
    if blocks.num_splits is not None:
        return blocks.num_splits
    want = triton.cdiv(2 * _num_sms(device), programs)
    longest = max(1, max_tokens // (4 * blocks.block_n))
    return max(1, min(want, longest, 64))


@register("mla_decode", "triton")
def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    blocks: DecodeBlocks | None = None,
) -> torch.Tensor:
    """q: [batch, heads, kv_lora_rank + rope_dim]; kv_cache: [num_blocks, block_size,
    kv_lora_rank + rope_dim]; block_tables: [batch, max_blocks] int; seq_lens: [batch] int.
    Returns [batch, heads, kv_lora_rank]. See mla_decode_torch."""
    blocks = blocks or DecodeBlocks()
    batch, num_heads, dim = q.shape
    _, block_size, kv_dim = kv_cache.shape
    if kv_dim != dim or kv_cache.dtype != q.dtype:
        raise TypeError(
            f"mla_decode: q {tuple(q.shape)} {q.dtype} vs cache "
            f"{tuple(kv_cache.shape)} {kv_cache.dtype}"
        )
    rope_dim = dim - kv_lora_rank
    out = empty((batch, num_heads, kv_lora_rank), q.dtype, q.device)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv_cache = kv_cache if kv_cache.stride(-1) == 1 else kv_cache.contiguous()
    block_h = min(blocks.block_h, next_pow2(num_heads, at_least=16))  # tl.dot: M >= 16
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = _num_splits(batch * head_blocks, block_tables.shape[1] * block_size, blocks, q.device)
    m = empty((batch, num_heads, splits), torch.float32, q.device)
    denom = empty((batch, num_heads, splits), torch.float32, q.device)
    acc = empty((batch, num_heads, splits, kv_lora_rank), torch.float32, q.device)
    block_r = next_pow2(kv_lora_rank, at_least=16)
    _split_kernel[(head_blocks, batch, splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        m,
        denom,
        acc,
        num_heads,
        kv_lora_rank,
        rope_dim,
        block_size,
        softmax_scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        NUM_SPLITS=splits,
        BLOCK_H=block_h,
        BLOCK_N=blocks.block_n,
        BLOCK_R=block_r,
        BLOCK_P=next_pow2(rope_dim, at_least=16),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    _merge_kernel[(num_heads, batch)](
        m,
        denom,
        acc,
        out,
        num_heads,
        kv_lora_rank,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        BLOCK_S=next_pow2(splits),
        BLOCK_R=block_r,
    )
    return out
