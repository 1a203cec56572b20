"""What every family's config shares: the error a config.json that Ferry cannot run raises, YaRN's
parameters, and the FP8 block and FP4 grid of a quantized checkpoint. Each family's own config class is in its
package (``v3/config.py``, ``v4/config.py``); ``registry`` picks one by ``model_type``. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# FP4 e2m1 (DeepSeek's routed experts, V4.1's cache entries): the code's magnitudes, bit 3 the
# sign; a checkpoint's FP4 weights have one E8M0 scale per FP4_BLOCK values of a row
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_BLOCK = 32


class ConfigError(ValueError):
    """A checkpoint's config.json describes a model Ferry cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (the only rope scaling DeepSeek-V3 ships with, and V4's compressed layers')."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_factor(self) -> float:
        """Factor on cos/sin (YaRN's attention factor; 1.0 for DeepSeek-V3's own settings)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.get_mscale(self.factor, self.mscale) / self.get_mscale(
                self.factor, self.mscale_all_dim
            )
        return self.get_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """Multiplier on the softmax scale: mscale(factor, mscale_all_dim) squared."""
        if not self.mscale_all_dim:
            return 1.0
        m = self.get_mscale(self.factor, self.mscale_all_dim)
        return m * m


def read_fp8_block(d: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The FP8 block of a config's quantization_config (None: not quantized); V3's and V4's."""
    q = d.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"{source}: unsupported quantization {q.get('quant_method')!r}")
    block = q.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])
