"""Rotary position embedding: DeepSeek-V3's MLA rope dims with YaRN scaling (as DeepSeek-V3 and
transformers compute it), and DeepSeek-V4's two interleaved tables."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ferry.services.engine.model.config import RopeScaling

if TYPE_CHECKING:
    from ferry.services.engine.model.v3.config import ModelConfig
    from ferry.services.engine.model.v4.config import V4ModelConfig


def _yarn_inv_freq(dim: int, base: float, rs: RopeScaling) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:
        return (
            dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rs.factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency per dim
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """cos/sin for a batch of positions, applied to [num_tokens, heads, rope_dim] tensors.
    Not an nn.Module: its frequencies are derived from the config, never loaded (and built on
    the CPU even under a meta-device context)."""

    def __init__(self, config: ModelConfig) -> None:
        dim, base = config.qk_rope_head_dim, config.rope_theta
        if config.rope_scaling is None:
            self.inv_freq = 1.0 / (
                base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
            )
            self.factor = 1.0
        else:
            self.inv_freq = _yarn_inv_freq(dim, base, config.rope_scaling)
            self.factor = config.rope_scaling.cos_sin_factor
        self.interleave = config.rope_interleave

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] -> (cos, sin), each [num_tokens, 1, rope_dim // 2]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = (freqs.cos() * self.factor).to(dtype)[:, None, :]
        sin = (freqs.sin() * self.factor).to(dtype)[:, None, :]
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: [num_tokens, heads, rope_dim]. The output is in half-split layout either way
        (interleaved checkpoints pair dims (0,1), (2,3)...; others pair (i, i + rope_dim/2))."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class V4Rope:
    """DeepSeek-V4's two RoPE tables over the trailing ``qk_rope_head_dim`` dims of a head,
    interleaved (pairs (0, 1), (2, 3), ...) and kept in place: K = V, so the attention output is
    rotated back with the same table, and the layout must survive the round trip.
    "main" (sliding-window layers): plain RoPE at ``rope_theta``. "compress" (CSA/HCA layers,
    their compressors and indexer): ``compress_rope_theta`` with YaRN frequencies and no
    attention factor on cos/sin or softmax (as transformers builds it)."""

    def __init__(self, config: V4ModelConfig) -> None:
        dim = config.qk_rope_head_dim
        self.dim = dim
        steps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        self.inv_freq = {"main": 1.0 / (config.rope_theta**steps)}
        self.factor = {"main": 1.0}
        rs = config.compress_rope_scaling
        if rs is None:
            self.inv_freq["compress"] = 1.0 / (config.compress_rope_theta**steps)
            self.factor["compress"] = 1.0
        else:
            self.inv_freq["compress"] = _yarn_inv_freq(dim, config.compress_rope_theta, rs)
            self.factor["compress"] = rs.cos_sin_factor

    def cos_sin(
        self, positions: torch.Tensor, table: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] -> (cos, sin), each [n, 1, rope_dim // 2] in ``dtype`` (rounded to
        it, as transformers does, before the float32 rotation)."""
        freqs = positions.float()[:, None] * self.inv_freq[table].to(positions.device)[None, :]
        f = self.factor[table]
        return (freqs.cos() * f).to(dtype)[:, None, :], (freqs.sin() * f).to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the trailing 2 * cos.shape[-1] dims of x: [n, heads, dim] in float32, in
        place of the pairs; the leading dims are untouched. ``-sin`` undoes a rotation."""
        rope_dim = 2 * cos.shape[-1]
        nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        c, s = cos.float(), sin.float()
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
        return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
