"""DeepSeek-V4's compressor pooling in one Triton kernel: one program per (entry, block of
channels) takes the softmax of the gate over the entry's rows, channel by channel, and sums the
rows with those weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, next_pow2, to_dtype

_LOG2E = tl.constexpr(1.4426950408889634)  # the softmax runs on exp2: gate · log2 e


@dataclass(frozen=True)
class PoolBlocks:
    """Each program holds a tile of at most ``block_r`` rows x ``tile // rows`` channels (at
    least 32): 8 x 512 for CSA, 128 x 64 for HCA at V4-Flash's width 512. An entry with more
    rows than ``block_r`` is read in row tiles twice: once for the softmax's max and sum, once
    for the weighted sum."""

    block_r: int = 128
    tile: int = 8192
    num_warps: int = 4


@triton.jit
def _compress_pool_kernel(
    kv_ptr,
    gate_ptr,
    out_ptr,
    rows,
    width,
    kv_stride_n,
    kv_stride_r,
    gate_stride_n,
    gate_stride_r,
    ONE_TILE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Entry pid(0), channels block pid(1), as compress_pool_torch computes it.

    kv, gate: [num_entries, rows, width] (unit stride along width); out: [num_entries, width]
    contiguous, kv's dtype. ONE_TILE: rows <= BLOCK_R, so gate and kv are read once.
    """
    n = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_mask = w < width
    r = tl.arange(0, BLOCK_R)
    kv_rows = kv_ptr + n * kv_stride_n + w[None, :]
    gate_rows = gate_ptr + n * gate_stride_n + w[None, :]
    if ONE_TILE:
        mask = (r < rows)[:, None] & w_mask[None, :]
        g = tl.load(gate_rows + r[:, None] * gate_stride_r, mask=mask, other=float("-inf"))
        # Channels past the width get a 0 gate, so that no NaN is computed (nor stored).
        g = tl.where(w_mask[None, :], g.to(tl.float32) * _LOG2E, 0.0)
        e = tl.exp2(g - tl.max(g, axis=0)[None, :])  # [BLOCK_R, BLOCK_W]; 0 for -inf rows
        weights = to_dtype(e / tl.sum(e, axis=0)[None, :], kv_ptr.dtype.element_ty)
        kv = tl.load(kv_rows + r[:, None] * kv_stride_r, mask=mask, other=0.0)
        acc = tl.sum(weights.to(tl.float32) * kv.to(tl.float32), axis=0)
    else:
        m = tl.full([BLOCK_W], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_W], tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            mask = (r0 + r < rows)[:, None] & w_mask[None, :]
            g = tl.load(
                gate_rows + (r0 + r)[:, None] * gate_stride_r, mask=mask, other=float("-inf")
            )
            g = tl.where(w_mask[None, :], g.to(tl.float32) * _LOG2E, 0.0)
            m_prev = m
            m = tl.maximum(m, tl.max(g, axis=0))
            # While a channel's rows are all -inf its m is -inf: shift by 0 there, not by m.
            shift = tl.where(m == float("-inf"), 0.0, m)
            denom = denom * tl.exp2(m_prev - shift) + tl.sum(tl.exp2(g - shift[None, :]), 0)
        acc = tl.zeros([BLOCK_W], tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            mask = (r0 + r < rows)[:, None] & w_mask[None, :]
            g = tl.load(
                gate_rows + (r0 + r)[:, None] * gate_stride_r, mask=mask, other=float("-inf")
            )
            g = tl.where(w_mask[None, :], g.to(tl.float32) * _LOG2E, 0.0)
            e = tl.exp2(g - m[None, :])
            weights = to_dtype(e / denom[None, :], kv_ptr.dtype.element_ty)
            kv = tl.load(kv_rows + (r0 + r)[:, None] * kv_stride_r, mask=mask, other=0.0)
            acc += tl.sum(weights.to(tl.float32) * kv.to(tl.float32), axis=0)
    tl.store(out_ptr + n * width + w, to_dtype(acc, out_ptr.dtype.element_ty), mask=w_mask)


@register("compress_pool", "triton")
def compress_pool_triton(
    kv: torch.Tensor, gate: torch.Tensor, *, blocks: PoolBlocks | None = None
) -> torch.Tensor:
    """kv, gate: [num_entries, rows, width] (any strides) -> [num_entries, width] in kv's
    dtype. See compress_pool_torch."""
    blocks = blocks or PoolBlocks()
    if kv.shape != gate.shape:
        raise TypeError(f"compress_pool: kv {tuple(kv.shape)} vs gate {tuple(gate.shape)}")
    num_entries, rows, width = kv.shape
    out = empty((num_entries, width), kv.dtype, kv.device)
    if num_entries == 0 or width == 0:
        return out
    if rows == 0:  # an empty sum
        return out.zero_()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    block_r = min(next_pow2(rows), blocks.block_r)
    block_w = min(next_pow2(width), max(32, blocks.tile // block_r))
    _compress_pool_kernel[(num_entries, triton.cdiv(width, block_w))](
        kv,
        gate,
        out,
        rows,
        width,
        kv.stride(0),
        kv.stride(1),
        gate.stride(0),
        gate.stride(1),
        ONE_TILE=rows <= block_r,
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        num_warps=blocks.num_warps,
    )
    return out
