"""Shared by the test_triton_*.py modules, which run under TRITON_INTERPRET=1 (see conftest.py)."""

from __future__ import annotations

from typing import Any

import torch

from ferry.kernels import dispatch
from ferry.kernels.triton_common import poisoned

# max |ours - reference| / max |reference|
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.float(), ref.float()
    assert torch.isfinite(ours).all(), "non-finite output (an element was never written?)"
    scale = ref.abs().max()
    return float((ours - ref).abs().max() / scale) if scale > 0 else float(ours.abs().max())


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (ours.shape, ours.dtype, ref.shape)
    err = rel_err(ours, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e} ({dtype})"
    return err


def triton(op: str, *args: Any, **kwargs: Any) -> Any:
    """The Triton implementation of ``op`` run with every buffer it allocates poisoned."""
    with poisoned():
        return dispatch.implementation(op, "triton")(*args, **kwargs)


def torch_ref(op: str, *args: Any) -> Any:
    return dispatch.implementation(op, "torch")(*args)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
