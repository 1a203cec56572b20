"""What DeepSeek-V4 and V4.1 build alike: V4's RMSNorm (weight applied in float32), mHC's
hyper-connection coefficients around a sublayer, and the grouped output projection."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ferry.services.engine.model.v4.config import V4ModelConfig
    from ferry.services.engine.model.v41.config import V41ModelConfig


class V4RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies in float32 before the cast back (V4's; V3's casts
    first). ``weight=False``: no weight (the per-head query norm, the mHC input norm)."""

    def __init__(self, dim: int, eps: float, weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return x * inv.to(x.dtype)
        return (self.weight * (x.float() * inv)).to(x.dtype)


class HyperConnection(nn.Module):
    """Mixes the ``hc_mult`` residual streams around one sublayer: ``pre`` collapses them into
    the sublayer's input, ``post`` spreads its output back, ``comb`` (made doubly stochastic by
    Sinkhorn) mixes the streams themselves. Kept in float32."""

    # ``forward`` (``mix``: coefficients and collapse together) is how the model uses it, so
    # the engine may compile ``mix``; V4.1 collapses with another sublayer's coefficients
    mixes_in_forward = True

    def __init__(self, config: V4ModelConfig | V41ModelConfig) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc, self.iters, self.eps = hc, config.hc_sinkhorn_iters, config.hc_eps
        self.norm = V4RMSNorm(hc * config.hidden_size, config.rms_norm_eps, weight=False)
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + hc) * hc))
        self.scale = nn.Parameter(torch.empty(3))
        # the same ``mix`` as one fused kernel, where the engine compiled it (piece_graphs.py)
        self.compiled: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc, hidden] -> (post [T, hc], comb [T, hc, hc], collapsed [T, hidden])."""
        if self.compiled is not None:
            return self.compiled(streams, self.fn, self.base, self.scale)
        return self.mix(streams, self.fn, self.base, self.scale)

    def mix(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` with the weights as arguments: one compiled graph serves every layer."""
        pre, post, comb = self.split(streams, fn, base, scale)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    def split(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three coefficient sets: pre [T, hc], post [T, hc], comb [T, hc, hc]."""
        hc = self.hc
        mixes = F.linear(self.norm(streams.flatten(1).float()), fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc)
        comb = comb.softmax(dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new streams: post ⊗ out + combᵀ · streams."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: the input splits into ``groups`` equal parts, each projected
    by its own rows of ``weight`` ([groups * out_per_group, in_per_group])."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, groups, in_per_group] -> [T, groups * out_per_group]."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)
