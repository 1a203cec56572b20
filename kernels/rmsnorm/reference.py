"""RMSNorm, computed in float32 and cast back as DeepSeek and transformers do."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import register


@register("rms_norm", "torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden]
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@register("add_rms_norm", "torch")
def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed
