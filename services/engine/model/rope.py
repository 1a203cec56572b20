"""Rotary position embedding for the MLA rope dims, with YaRN scaling (as DeepSeek-V3 and
transformers compute it)."""

from __future__ import annotations

import math

import torch

from ferry.services.engine.model.config import ModelConfig, RopeScaling


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
