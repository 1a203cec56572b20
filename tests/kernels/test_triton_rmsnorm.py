"""rms_norm and add_rms_norm: Triton (interpreted) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton

SHAPES = [(1, 64), (7, 100), (3, 5, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = generator(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    assert_matches(triton("rms_norm", x, w, 1e-6), torch_ref("rms_norm", x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = generator(10 + sum(shape))
    x, res = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    normed, summed = triton("add_rms_norm", x, res, w, 1e-6)
    ref_normed, ref_summed = torch_ref("add_rms_norm", x, res, w, 1e-6)
    assert_matches(normed, ref_normed, dtype)
    assert_matches(summed, ref_summed, dtype)


def test_strided_rows_and_float32_weight_on_bfloat16() -> None:
    """A non-contiguous input, and the reference's dtype promotion (bf16 x, fp32 weight)."""
    gen = generator(3)
    x = torch.randn(6, 80, generator=gen).to(torch.bfloat16)[:, ::2]  # [6, 40], stride 2
    w = 1 + 0.1 * torch.randn(40, generator=gen)
    out = triton("rms_norm", x, w, 1e-5)
    assert out.dtype == torch.float32
    assert_matches(out, torch_ref("rms_norm", x, w, 1e-5), torch.bfloat16)


def test_no_rows() -> None:
    x, w = torch.empty(0, 64), torch.ones(64)
    assert triton("rms_norm", x, w, 1e-6).shape == (0, 64)
    normed, summed = triton("add_rms_norm", x, x, w, 1e-6)
    assert normed.shape == summed.shape == (0, 64)
