"""Pieces the Triton kernels share. Importing this module imports Triton, so only the kernel
modules import it (and :mod:`kernels.dispatch` imports those on first use)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

# NOTE: Triton 3.9's interpreter multiplies bfloat16 dot operands as their raw uint16 bits, and
# casts float32 to bfloat16 by truncation where GPUs round to nearest even. Under the interpreter
# `mma` upcasts bfloat16 operands to float32 first (float32 products of bfloat16 values are exact,
# so only the accumulation order differs from tensor cores) and `to_dtype` rounds by hand.
_INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)

_poison = False


@triton.jit
def mma(a, b, acc):
    """acc + a @ b with a float32 accumulator; float32 operands are multiplied in full (IEEE)
    precision rather than TF32, so the float32 path matches the torch reference to 1e-5."""
    if _INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:  # noqa: SIM108 (a static if, kept a statement in kernels)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """float32 ``x`` as ``dtype``, rounded to nearest even on the GPU and in the interpreter."""
    y = x.to(dtype)
    if _INTERPRETED:  # noqa: SIM102 (two static ifs: no boolean ops on constexprs in kernels)
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty for a buffer a kernel fills; NaN (or a huge integer) inside :func:`poisoned`,
    so that a test sees any element a kernel forgot to write or read before it was written."""
    if not _poison:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min // 2
    return torch.full(shape, fill, dtype=dtype, device=device)


@contextmanager
def poisoned() -> Iterator[None]:
    """Within this block every buffer from :func:`empty` starts out poisoned (tests)."""
    global _poison
    before, _poison = _poison, True
    try:
        yield
    finally:
        _poison = before


def next_pow2(n: int, at_least: int = 1) -> int:
    return max(triton.next_power_of_2(n), at_least)
