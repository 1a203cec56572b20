"""DeepSeek-V4.1's FP8 and FP4 formats, bit for bit as its reference kernels compute them.

Activation and cache quantise-dequantise (QDQ) points, each group taken along the last dim:
- ``fp8_qdq``: e4m3 per 32 with a UE8M0 (power-of-two) scale: the window KV, the DSpark KV and
  the activations of the FP8/FP4 GEMMs (``act_quant``);
- ``fp4_qdq_e8m0``: E2M1 per 32 with an E8M0 scale: the indexer's query and keys;
- ``fp4_qdq_e4m3``: E2M1 per 16 with an E4M3 scale: the compressed KV entries.
Each has a ``*_quant`` twin returning the codes and scales a packed cache stores, read back by
``fp8_dequant`` / ``fp4_dequant``; ``*_qdq`` is exactly dequant(quant(x)).

Weight writers in DeepSeek's released layout, the inverse of ``loader.dequantize_fp8`` and
``loader.dequantize_fp4``: ``quantize_fp8_blocks`` (dense linears, 32x32 tiles) and
``quantize_fp4`` (routed experts).

Everything is computed in float32 (the kernels read bf16 and widen it) and rounds to nearest
even; inputs must be finite. A group past the end of the last dim is zero-padded, which leaves
its amax unchanged (the kernels require whole groups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.services.engine.config import KV_CACHE_DTYPES
from ferry.services.engine.model.config import E2M1, FP4_BLOCK

FP8_MAX = 448.0
FP4_MAX = 6.0
# the amax floors: an all-zero group still gets a finite, nonzero scale
FP8_AMAX_MIN = 1e-4
FP4_E8M0_AMAX_MIN = 6 * 2.0**-126
FP4_E4M3_AMAX_MIN = 6 * 2.0**-9  # amax / 6 is then at least e4m3's smallest subnormal
# NOTE: the kernels form amax / max as amax times the float32 reciprocal. For a power-of-two
# scale this never changes the result (the product is within half an ulp of the quotient at a
# power of two), but it is kept so the scale is computed exactly as theirs.
_FP8_MAX_INV = torch.tensor(1 / FP8_MAX, dtype=torch.float32)
_FP4_MAX_INV = torch.tensor(1 / FP4_MAX, dtype=torch.float32)
_E2M1_TABLE = torch.tensor([*E2M1, *(-v for v in E2M1)])  # by 4-bit code; bit 3 is the sign


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., n] -> float32 [..., ceil(n / block), block], zero-padded."""
    x = F.pad(x.float(), (0, -x.shape[-1] % block))
    return x.unflatten(-1, (-1, block))


def _ungroup(g: torch.Tensor, n: int) -> torch.Tensor:
    """[..., groups, block] -> [..., n]: the padding dropped."""
    return g.flatten(-2)[..., :n].contiguous()


def _ue8m0(amax: torch.Tensor, max_inv: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax * max_inv)) as E8M0 (its byte is the biased exponent).

    ``amax * max_inv`` must be a normal float32, which the amax floors guarantee: x = m * 2^e
    with m in [0.5, 1) has ceil(log2 x) = e, or e - 1 when x is a power of two (m = 0.5)."""
    mantissa, exponent = torch.frexp(amax * max_inv)
    log2_ceil = exponent - (mantissa == 0.5).to(exponent.dtype)
    return (log2_ceil + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3, nearest even, saturating at +-448 (a bare cast makes overflow NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 in [-6, 6] -> 4-bit E2M1 codes (uint8), nearest even; bit 3 is the sign bit of
    ``v``, so a negative value that rounds to zero keeps its sign (code 8, -0.0).

    The grid's step is 0.5 below 2, 1 below 4, then 2; a magnitude's code is its count of steps
    plus 0, 2 or 4, so the code is even exactly when that count is, and rounding the count half
    to even rounds the code to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4."""
    mag = v.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    steps = torch.round(mag / step)
    code = steps + torch.where(mag < 2, 0.0, torch.where(mag < 4, 2.0, 4.0))
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def _pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., n] (n even) -> int8 [..., n / 2], the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., n / 2] -> 4-bit codes int64 [..., n]."""
    b = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def _require_even(x: torch.Tensor) -> None:
    if x.shape[-1] % 2:
        raise ValueError(f"FP4 packs two values a byte: last dim {x.shape[-1]} is odd")


def fp8_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 codes [..., n], E8M0 scales [..., ceil(n / block)]).

    Per group: amax = max |x| floored at 1e-4; scale = 2^ceil(log2(amax * f32(1/448)));
    code = e4m3(clamp(x / scale, +-448)), nearest even. The scale is the smallest power of two
    that fits amax in 448: amax 448 * 2^k gets 2^k exactly (amax 224: scale 0.5, code 448)."""
    g = _groups(x, block)  # [..., groups, block]
    scale = _ue8m0(g.abs().amax(-1).clamp_min(FP8_AMAX_MIN), _FP8_MAX_INV)
    codes = _e4m3(g / scale.float().unsqueeze(-1))
    return _ungroup(codes, x.shape[-1]), scale


def fp8_dequant(
    codes: torch.Tensor, scales: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """e4m3 codes [..., n] times their per-group scale [..., ceil(n / block)], as ``dtype``."""
    g = _groups(codes, block) * scales.float().unsqueeze(-1)
    return _ungroup(g, codes.shape[-1]).to(dtype)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What ``act_quant(x, inplace=True)`` leaves in x: x rounded through ``fp8_quant``, in x's
    dtype. Idempotent."""
    return fp8_dequant(*fp8_quant(x, block), block, x.dtype)


def fp4_quant_e8m0(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (packed E2M1 int8 [..., n / 2], E8M0 scales [..., ceil(n / block)]).

    Per group: amax = max |x| floored at 6 * 2^-126; scale = 2^ceil(log2(amax * f32(1/6)));
    code = E2M1(clamp(x / scale, +-6)), nearest even on 0, 0.5, 1, 1.5, 2, 3, 4, 6. A group
    whose amax is 6 * 2^k gets 2^k exactly (amax 3: scale 0.5, code 6)."""
    _require_even(x)
    g = _groups(x, block)
    scale = _ue8m0(g.abs().amax(-1).clamp_min(FP4_E8M0_AMAX_MIN), _FP4_MAX_INV)
    codes = _e2m1_codes((g / scale.float().unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return _pack_fp4(_ungroup(codes, x.shape[-1])), scale


def fp4_quant_e4m3(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (packed E2M1 int8 [..., n / 2], e4m3 scales [..., ceil(n / block)]).

    Per group: amax = max |x| floored at 6 * 2^-9; scale = e4m3(amax / 6), nearest even and
    saturating at 448; code = E2M1(clamp(x / scale, +-6)) with x / scale a rounded float32
    division. The scale may round below amax / 6, so the largest values can clamp at 6.

    NOTE: not idempotent for amax / 6 in [1.5, 5/3) * 2^-9: that subnormal scale rounds up to
    2^-8 and the largest value down to 4 * 2^-8 = 2^-6, whose own scale is then 2^-9. Elsewhere
    the largest value always rounds to 6 and requantising changes nothing."""
    _require_even(x)
    g = _groups(x, block)
    scale = _e4m3(g.abs().amax(-1).clamp_min(FP4_E4M3_AMAX_MIN) / FP4_MAX)
    codes = _e2m1_codes((g / scale.float().unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return _pack_fp4(_ungroup(codes, x.shape[-1])), scale


def fp4_dequant(
    packed: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed E2M1 [..., n / 2] times their per-group scale [..., ceil(n / block)] (E8M0 or
    e4m3), as ``dtype``. -0.0 codes stay -0.0."""
    values = _E2M1_TABLE.to(packed.device)[_unpack_fp4(packed)]  # [..., n]
    g = _groups(values, block) * scales.float().unsqueeze(-1)
    return _ungroup(g, values.shape[-1]).to(dtype)


def fp4_qdq_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What ``fp4_act_quant(x, inplace=True)`` with E8M0 scales leaves in x: x rounded through
    ``fp4_quant_e8m0``, in x's dtype. Idempotent."""
    return fp4_dequant(*fp4_quant_e8m0(x, block), block, x.dtype)


def fp4_qdq_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """What ``fp4_act_quant(x, inplace=True)`` with e4m3 scales leaves in x: x rounded through
    ``fp4_quant_e4m3``, in x's dtype (idempotent but for the NOTE there)."""
    return fp4_dequant(*fp4_quant_e4m3(x, block), block, x.dtype)


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = (32, 32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight as DeepSeek releases it: w [out, in] -> (e4m3 [out, in], E8M0 scales
    [ceil(out / b0), ceil(in / b1)]), one scale per tile by ``fp8_quant``'s rule over the whole
    tile (edge tiles over the rows and columns they have). ``loader.dequantize_fp8`` reads it."""
    rows, cols = w.shape
    b0, b1 = block
    tiles = F.pad(w.float(), (0, -cols % b1, 0, -rows % b0))
    tiles = tiles.unflatten(1, (-1, b1)).unflatten(0, (-1, b0))  # [out/b0, b0, in/b1, b1]
    scale = _ue8m0(tiles.abs().amax((1, 3)).clamp_min(FP8_AMAX_MIN), _FP8_MAX_INV)
    codes = _e4m3(tiles / scale.float()[:, None, :, None])
    return codes.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed expert's weight as DeepSeek releases it: w [out, in] -> (int8 [out, in / 2], two
    E2M1 codes a byte with the even element in the low nibble and the sign in bit 3; E8M0 scales
    [out, ceil(in / 32)]), by ``fp4_quant_e8m0``'s rule. ``loader.dequantize_fp4`` reads it."""
    if w.dim() != 2:
        raise ValueError(f"an FP4 weight is [out, in], got shape {list(w.shape)}")
    return fp4_quant_e8m0(w, FP4_BLOCK)


# ---- the KV cache's formats ------------------------------------------------------------------


@dataclass(frozen=True)
class RowCodec:
    """One cached row kind stored packed: its codes then its scales, as bytes. ``qdq`` is what
    attention reads back; ``encode`` / ``decode`` the bytes a cache holds, decode(encode(x)) =
    qdq(x)."""

    quant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequant: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    code_bytes: Callable[[int], int]  # a row of n values: its codes' bytes
    block: int

    def row_bytes(self, n: int) -> int:
        return self.code_bytes(n) + -(-n // self.block)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(*self.quant(x), x.dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] -> uint8 [..., row_bytes(n)]."""
        codes, scales = self.quant(x)
        return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=-1)

    def decode(self, packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., row_bytes(n)] -> [..., n] as ``dtype``."""
        at = self.code_bytes(n)
        codes, scales = packed[..., :at], packed[..., at:]
        return self.dequant(codes, scales, dtype)


FP8_ROWS = RowCodec(
    fp8_quant,
    lambda c, s, dt: fp8_dequant(c.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), 32, dt),
    lambda n: n,
    32,
)
FP4_E4M3_ROWS = RowCodec(
    lambda x: fp4_quant_e4m3(x, 16),
    lambda c, s, dt: fp4_dequant(c, s.view(torch.float8_e4m3fn), 16, dt),
    lambda n: n // 2,
    16,
)
FP4_E8M0_ROWS = RowCodec(
    fp4_quant_e8m0,
    lambda c, s, dt: fp4_dequant(c, s.view(torch.float8_e8m0fnu), 32, dt),
    lambda n: n // 2,
    32,
)


@dataclass(frozen=True)
class CacheFormat:
    """How attention rounds what it caches (``--kv-cache-dtype``). ``auto``: kept as computed,
    in the model's dtype. ``fp8``: the released model's quantisation points, each applied where
    DeepSeek's reference applies it and stored packed: the window's rows FP8 per 32 with UE8M0
    scales (RoPE dims included), the compressed entries FP4 per 16 with E4M3 scales, the index
    keys FP4 per 32 with E8M0 scales (the indexer's queries are rounded alike, not stored)."""

    name: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
            )

    @property
    def packed(self) -> bool:
        return self.name == "fp8"

    @property
    def window(self) -> RowCodec | None:
        return FP8_ROWS if self.packed else None

    @property
    def entries(self) -> RowCodec | None:
        return FP4_E4M3_ROWS if self.packed else None

    @property
    def index(self) -> RowCodec | None:
        return FP4_E8M0_ROWS if self.packed else None


AUTO = CacheFormat()


def rounded(codec: RowCodec | None, x: torch.Tensor) -> torch.Tensor:
    """x as a cache of ``codec``'s format gives it back (None: as it is)."""
    return x if codec is None else codec.qdq(x)
