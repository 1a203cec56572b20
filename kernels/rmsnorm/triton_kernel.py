"""RMSNorm and residual add + RMSNorm: one Triton program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.triton_common import empty, next_pow2, to_dtype


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    x_stride,
    res_stride,
    out_stride,
    sum_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row per program, as :func:`kernels.rmsnorm.reference.rms_norm_torch` computes it.

    x, res, sum: [rows, n_cols] (row strides given, columns contiguous); w: [n_cols];
    out: [rows, n_cols]. With HAS_RESIDUAL, sum = x + res (in sum's dtype) is stored and
    normalised instead of x. The norm runs in float32, is cast to the normalised tensor's dtype,
    then multiplied by w, as the reference does.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = to_dtype(x.to(tl.float32) + res.to(tl.float32), sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = to_dtype(h * rstd, x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = to_dtype(w * normed, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] as [rows, hidden] with contiguous columns."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)  # [rows, hidden]
    res2 = _rows(residual) if residual is not None else x2
    normed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = empty(x2.shape, torch.promote_types(weight.dtype, normed_dtype), x.device)
    summed = empty(x2.shape, normed_dtype, x.device) if residual is not None else None
    if x2.shape[0]:
        block = next_pow2(hidden)
        sum_arg = summed if summed is not None else out
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight.contiguous(),
            out,
            sum_arg,
            hidden,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            sum_arg.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )
    shape = x.shape
    return out.view(shape), (summed.view(shape) if summed is not None else None)


@register("rms_norm", "triton")
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. See rms_norm_torch."""
    return _launch(x, None, weight, eps)[0]


@register("add_rms_norm", "triton")
def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), both [..., hidden]."""
    normed, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return normed, summed
