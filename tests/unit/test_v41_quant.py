"""DeepSeek-V4.1's FP8/FP4 formats (``model/v41/quant.py``). The QDQ rules on vectors whose
results were derived by hand (ties, amax at a power of two and a hair above it, zeros, values
under the amax floor, saturation, signed zeros), compared bit for bit; idempotence; the writers
read back by the loader; and DeepSeek's golden checkpoint re-quantised from its own values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from ferry.services.engine.model.loader import dequantize_fp4, dequantize_fp8
from ferry.services.engine.model.v41.quant import (
    fp4_dequant,
    fp4_qdq_e4m3,
    fp4_qdq_e8m0,
    fp4_quant_e4m3,
    fp4_quant_e8m0,
    fp8_dequant,
    fp8_qdq,
    fp8_quant,
    quantize_fp4,
    quantize_fp8_blocks,
)
from tests.v41_golden import case_dir


def group(values: list[float], n: int = 32, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One group: ``values`` then zeros, [n]."""
    return torch.tensor(values + [0.0] * (n - len(values)), dtype=dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit patterns, so that -0.0 differs from 0.0."""
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def assert_bits(ours: torch.Tensor, expected: list[float]) -> None:
    """The first len(expected) values equal ``expected`` bit for bit."""
    got = ours[: len(expected)].float()
    assert torch.equal(bits(got), bits(torch.tensor(expected, dtype=torch.float32))), got


def e8m0_exponent(scale: torch.Tensor) -> list[int]:
    return (scale.view(torch.uint8).to(torch.int64) - 127).flatten().tolist()


def e4m3_byte(scale: torch.Tensor) -> list[int]:
    return scale.view(torch.uint8).flatten().tolist()


# --- FP8 e4m3, UE8M0 scale per 32 (act_quant: window KV, GEMM activations) ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_amax_448_has_scale_1_and_e4m3_ties_go_to_even(dtype: torch.dtype) -> None:
    x = [448, -448, 1.0625, 1.1875, 17, 19, 2**-10, 3 * 2**-10, -5 * 2**-10, -(2**-12)]
    x += [0.0, -0.0, 300, 240]
    out = fp8_qdq(group(x, dtype=dtype))
    assert out.dtype == dtype
    # 1.0625: 1 | 1.125 -> 1; 1.1875: 1.125 | 1.25 -> 1.25; 17: 16 | 18 -> 16; 19: 18 | 20 -> 20;
    # subnormals step 2^-9: 2^-10 -> 0, 3*2^-10 -> 2^-8, -5*2^-10 -> -2^-8; -2^-12 -> -0.0;
    # 300 on [256, 448) step 32 -> 288
    assert_bits(out, [448, -448, 1, 1.25, 16, 20, 0, 2**-8, -(2**-8), -0.0, 0, -0.0, 288, 240])
    assert e8m0_exponent(fp8_quant(group(x, dtype=dtype))[1]) == [0]


def test_fp8_amax_448_times_a_power_of_two_gets_exactly_that_power() -> None:
    codes, scale = fp8_quant(group([224, -112, 1, 2**-10]))
    assert e8m0_exponent(scale) == [-1]
    assert_bits(codes.float(), [448, -224, 2, 2**-9])
    # 2^-10 survives at scale 1/2 (it is code 2^-9), where scale 1 would round it to 0
    assert_bits(fp8_qdq(group([224, -112, 1, 2**-10])), [224, -112, 1, 2**-10])


def test_fp8_amax_above_a_power_of_two_doubles_the_scale() -> None:
    # 225 / 448 < 1: scale 1, and 225 rounds to 224 (step 16)
    assert_bits(fp8_qdq(group([225, 2**-10])), [224, 0])
    # 448 * 2^10 plus one float32 ulp: scale 2^11 (log2 rounded in float32 would give 10 and
    # keep 1.5 as 2); 1.5 / 2^11 = 0.375 * 2^-9 rounds to 0
    x = group([458752.03125, 1.5])
    assert e8m0_exponent(fp8_quant(x)[1]) == [11]
    assert_bits(fp8_qdq(x), [458752, 0])


def test_fp8_amax_under_the_floor_uses_scale_2_pow_minus_22() -> None:
    # amax floored at 1e-4: 1e-4 / 448 = 2.23e-7 in (2^-23, 2^-22]
    x = group([2**-17, 5 * 2**-20, -(2**-30), 3 * 2**-32, 2**-32, 41 * 2**-22])
    assert e8m0_exponent(fp8_quant(x)[1]) == [-22]
    # codes 32, 20, -2^-8, 3*2^-10 -> 2^-8 (tie), 2^-10 -> 0 (tie), 41 -> 40 (step 4)
    assert_bits(fp8_qdq(x), [2**-17, 5 * 2**-20, -(2**-30), 2**-30, 0, 40 * 2**-22])
    zeros_codes, zeros_scale = fp8_quant(torch.zeros(32))
    assert e8m0_exponent(zeros_scale) == [-22] and not zeros_codes.float().any()


def test_fp8_groups_run_along_the_last_dim_each_with_its_scale() -> None:
    x = torch.zeros(2, 3, 64)
    x[..., 0] = 448.0
    x[..., 32] = 1.0  # 1 / 448 -> scale 2^-8, code 256
    codes, scale = fp8_quant(x)
    assert codes.shape == (2, 3, 64) and codes.dtype == torch.float8_e4m3fn
    assert scale.shape == (2, 3, 2) and scale.dtype == torch.float8_e8m0fnu
    assert e8m0_exponent(scale) == [0, -8] * 6
    assert float(codes[0, 0, 32]) == 256.0
    assert torch.equal(fp8_dequant(codes, scale), x)


# --- FP4 E2M1, E8M0 scale per 32 (indexer q and keys) ---


def test_fp4_e8m0_amax_6_has_scale_1_and_e2m1_ties_go_to_even() -> None:
    x = [6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.5, -0.1, 2.9, -4.75]
    # ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    expected = [6, -6, 0, 1, 1, 2, 2, 4, 4, 6, -0.0, 3, -4]
    assert_bits(fp4_qdq_e8m0(group(x)), expected)
    assert e8m0_exponent(fp4_quant_e8m0(group(x))[1]) == [0]
    assert_bits(fp4_qdq_e8m0(group(x, dtype=torch.bfloat16)), [6, -6, 0, 1, 1, 2, 2, 4, 4, 6])


def test_fp4_e8m0_scale_at_and_above_a_power_of_two() -> None:
    # amax 3 = 6 * 2^-1: scale 1/2; x / scale = 6, 0.5, 0.75 -> 1, -2.5 -> -2
    assert e8m0_exponent(fp4_quant_e8m0(group([3.0]))[1]) == [-1]
    assert_bits(fp4_qdq_e8m0(group([3, 0.25, 0.375, -1.25])), [3, 0.25, 0.5, -1])
    # amax 6.5: scale 2; x / scale = 3.25 -> 3, 0.5, 0.25 -> 0, -1.375 -> -1.5
    assert e8m0_exponent(fp4_quant_e8m0(group([6.5]))[1]) == [1]
    assert_bits(fp4_qdq_e8m0(group([6.5, 1, 0.5, -2.75])), [6, 1, 0, -3])


def test_fp4_e8m0_amax_under_the_floor_uses_scale_2_pow_minus_126() -> None:
    x = group([3 * 2**-128, 2**-130, -(2**-127)])  # float32 subnormals
    assert e8m0_exponent(fp4_quant_e8m0(x)[1]) == [-126]
    # x / 2^-126 = 0.75 -> 1, 0.0625 -> 0, -0.5
    assert_bits(fp4_qdq_e8m0(x), [2**-126, 0, -(2**-127)])
    assert e8m0_exponent(fp4_quant_e8m0(torch.zeros(32))[1]) == [-126]
    assert_bits(fp4_qdq_e8m0(torch.zeros(32)), [0.0] * 32)


# --- FP4 E2M1, e4m3 scale per 16 (compressed KV entries) ---


def test_fp4_e4m3_scale_not_a_power_of_two() -> None:
    x = group([7.5, 1, 3.125, 4.375, -0.3125, 0.9375], n=16)
    packed, scale = fp4_quant_e4m3(x)
    assert e4m3_byte(scale) == [0x3A]  # 1.25 = 7.5 / 6
    # x / 1.25 = 6, 0.8 -> 1, 2.5 -> 2, 3.5 -> 4, -0.25 -> -0, 0.75 -> 1
    assert_bits(fp4_qdq_e4m3(x), [7.5, 1.25, 2.5, 5, -0.0, 1.25])
    assert packed.shape == (8,) and packed.dtype == torch.int8


def test_fp4_e4m3_divides_by_the_scale() -> None:
    # scale 1.875: each x / scale is exactly a tie (1.25, 2.5, 5) and rounds down to even;
    # x * f32(1 / 1.875) would land one ulp above the tie and round up
    x = group([11.25, 2.34375, 4.6875, 9.375], n=16)
    assert e4m3_byte(fp4_quant_e4m3(x)[1]) == [0x3F]
    assert_bits(fp4_qdq_e4m3(x), [11.25, 1.875, 3.75, 7.5])


def test_fp4_e4m3_scale_rounds_down_or_saturates_and_values_clamp_at_6() -> None:
    # 6.375 / 6 = 1.0625, a tie between e4m3 1 and 1.125: scale 1, and 6.375 clamps to 6
    assert_bits(fp4_qdq_e4m3(group([6.375, -6.375, 5.5], n=16)), [6, -6, 6])
    # 3000 / 6 = 500 saturates at 448; 3000 / 448 = 6.7 clamps to 6
    x = group([3000, -448, 224], n=16)
    assert e4m3_byte(fp4_quant_e4m3(x)[1]) == [0x7E]
    assert_bits(fp4_qdq_e4m3(x), [2688, -448, 224])


def test_fp4_e4m3_floor_and_subnormal_scales() -> None:
    zeros, scale = fp4_quant_e4m3(torch.zeros(16))
    assert e4m3_byte(scale) == [0x01] and not zeros.any()  # 2^-9, e4m3's smallest
    assert_bits(fp4_qdq_e4m3(group([2**-12], n=16)), [0])  # 2^-12 / 2^-9 = 0.125 -> 0
    # 0.05 / 6 = 4.27 * 2^-9 -> 4 * 2^-9 = 2^-7; 0.05 / 2^-7 = 6.4 -> 6; 0.01 / 2^-7 = 1.28 -> 1.5
    x = group([0.05, 0.01], n=16)
    assert e4m3_byte(fp4_quant_e4m3(x)[1]) == [0x04]
    assert_bits(fp4_qdq_e4m3(x), [6 * 2**-7, 1.5 * 2**-7])


def test_fp4_e4m3_is_not_idempotent_where_the_scale_rounds_up_by_a_third() -> None:
    # amax 9 * 2^-9: scale 1.5 * 2^-9 -> 2^-8 (tie, even), 4.5 -> 4: 2^-6; then 2^-6 / 6 =
    # 1.33 * 2^-9 -> scale 2^-9, 8 clamps to 6: 3 * 2^-8
    once = fp4_qdq_e4m3(group([9 * 2**-9], n=16))
    assert_bits(once, [2**-6])
    assert_bits(fp4_qdq_e4m3(once), [3 * 2**-8])


# --- shared properties ---


def spread(shape: tuple[int, ...], low: int, high: int, block: int) -> torch.Tensor:
    """Gaussian values, each group at a random power of two in [2^low, 2^high)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).unflatten(-1, (-1, block))
    exps = torch.randint(low, high, (*x.shape[:-1], 1), generator=g).float()
    return (x * torch.exp2(exps)).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdq_is_idempotent(dtype: torch.dtype) -> None:
    x = spread((64, 256), -140, 120, 32).to(dtype)
    for qdq in (fp8_qdq, fp4_qdq_e8m0):
        once = qdq(x)
        assert once.dtype == dtype
        assert torch.equal(bits(qdq(once)), bits(once)), qdq
    # every group's amax at least 6 * 2^-6 = 0.094, where the e4m3 scale is normal
    y = spread((64, 256), -140, 120, 16).to(dtype)
    y[..., ::16] = 0.1
    once = fp4_qdq_e4m3(y)
    assert torch.equal(bits(fp4_qdq_e4m3(once)), bits(once))


def test_the_packed_activation_codes_read_back_with_the_loader() -> None:
    x = spread((48, 128), -20, 20, 32)
    codes, scale = fp8_quant(x)
    assert torch.equal(dequantize_fp8(codes, scale, (1, 32), "s", "f"), fp8_qdq(x))
    packed, scale = fp4_quant_e8m0(x)
    assert packed.shape == (48, 64) and scale.shape == (48, 4)
    assert torch.equal(dequantize_fp4(packed, scale, "s", "f"), fp4_qdq_e8m0(x))
    assert torch.equal(fp4_dequant(packed, scale, 32), fp4_qdq_e8m0(x))


def test_fp4_rejects_odd_widths_and_non_matrices() -> None:
    with pytest.raises(ValueError, match="odd"):
        fp4_quant_e8m0(torch.ones(3, 33))
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        quantize_fp4(torch.ones(2, 3, 32))


# --- weight writers ---


def test_fp8_weight_round_trip_through_the_loader() -> None:
    w = torch.randn(70, 100, generator=torch.Generator().manual_seed(1)) * 0.02
    w[:32, :32] *= 1000  # tiles with different scales
    codes, scale = quantize_fp8_blocks(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert codes.shape == (70, 100) and scale.shape == (3, 4)
    back = dequantize_fp8(codes, scale, (32, 32), "s", "f")
    tile = scale.float().repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :100]
    # half a step: 2^-4 relative among normal e4m3 codes, 2^-10 * scale among subnormal ones
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, tile * 2**-10)).all()
    again = dequantize_fp8(*quantize_fp8_blocks(back), (32, 32), "s", "f")
    assert torch.equal(again, back)  # on the grid: exact


def test_fp4_weight_layout_and_round_trip_through_the_loader() -> None:
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([1.0, -6.0, 0.5, 3.0])  # scale 1: codes 2, 8 | 7, 1, 5
    w[1] = torch.randn(64, generator=torch.Generator().manual_seed(2))
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 32) and scale.shape == (2, 2)
    assert packed[0, :2].view(torch.uint8).tolist() == [0xF2, 0x51]  # even element: low nibble
    assert e8m0_exponent(scale[0]) == [0, -126]
    back = dequantize_fp4(packed, scale, "s", "f")
    assert_bits(back[0], [1, -6, 0.5, 3])
    tile = scale.float().repeat_interleave(32, 1)
    # half a step: a quarter of the value from 1 up, a quarter of the scale below
    assert ((back - w).abs() <= 0.25 * torch.maximum(w.abs(), tile)).all()
    assert torch.equal(dequantize_fp4(*quantize_fp4(back), "s", "f"), back)  # on the grid: exact


# --- DeepSeek's checkpoint: dequantised by the loader, re-quantised by the writers ---
# A stored block whose largest code is the bottom of the scale's range (e4m3 224, E2M1 3) holds
# the same values as codes x 2 at scale / 2, which is what the writers choose for them: amax
# 224 * s is 448 * s/2. Every other block must come back bit for bit.


def golden_weights(kind: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, codes, scale) of each weight of mini-flash-fp8 stored as ``kind`` (a safetensors
    dtype name)."""
    with safe_open(case_dir("mini-flash-fp8") / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if k.endswith(".weight")]  # noqa: SIM118
        return [
            (k, f.get_tensor(k), f.get_tensor(k.removesuffix("weight") + "scale"))
            for k in names
            if f.get_slice(k).get_dtype() == kind
        ]


def block_max(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] -> the max of each block [ceil(rows / b0), ceil(cols / b1)]."""
    b0, b1 = block
    x = F.pad(x, (0, -x.shape[1] % b1, 0, -x.shape[0] % b0))
    return x.unflatten(1, (-1, b1)).unflatten(0, (-1, b0)).amax((1, 3))


def per_value(blocks: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """A value per block -> one per element [rows, cols]."""
    full = blocks.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def halved(scale: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """E8M0 ``scale`` divided by 2 where ``where``: its exponent byte less one."""
    return (scale.view(torch.uint8) - where.to(torch.uint8)).view(torch.float8_e8m0fnu)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_golden_fp8_weights_requantise_to_their_codes_and_scales() -> None:
    bottoms = 0
    for name, codes, scale in golden_weights("F8_E4M3"):
        block = (1, 32) if "engram.embed" in name else (32, 32)  # Engram tables: per row
        values = dequantize_fp8(codes, scale, block, name, "golden")
        ours, our_scale = quantize_fp8_blocks(values, block)
        bottom = block_max(codes.float().abs(), block) == 224
        bottoms += int(bottom.sum())
        doubled = per_value(bottom, block, codes.shape)
        expected = torch.where(doubled, codes.float() * 2, codes.float()).to(torch.float8_e4m3fn)
        assert same_bytes(ours, expected), name
        assert same_bytes(our_scale, halved(scale, bottom)), name
        again = dequantize_fp8(ours, our_scale, block, name, "ours")
        assert torch.equal(again.view(torch.int32), values.view(torch.int32)), name
    assert bottoms > 0


# E2M1 magnitude code -> the code of twice its value (0 -> 0, 0.5 -> 1, ..., 3 -> 6)
TWICE = torch.tensor([0, 2, 4, 5, 6, 7, -1, -1])


def test_golden_fp4_experts_requantise_to_their_codes_and_scales() -> None:
    by_width: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for _, packed, scale in golden_weights("I8"):
        by_width.setdefault(packed.shape[1], []).append((packed, scale))
    bottoms = 0
    for width, weights in by_width.items():
        # FP4 scales run along rows, so every expert of one width is checked as one tensor
        packed, scale = (torch.cat(part) for part in zip(*weights, strict=True))
        name = f"the experts {width * 2} wide"
        values = dequantize_fp4(packed, scale, name, "golden")
        ours, our_scale = quantize_fp4(values)
        byte = packed.view(torch.uint8).to(torch.int64)
        nibbles = torch.stack([byte & 0xF, byte >> 4], dim=-1).flatten(-2)  # [out, in]
        bottom = block_max(nibbles & 7, (1, 32)) == 5  # the largest magnitude is 3
        bottoms += int(bottom.sum())
        twice = torch.where(
            per_value(bottom, (1, 32), nibbles.shape), TWICE[nibbles & 7], nibbles & 7
        )
        expected = twice | (nibbles & 8)
        expected = expected[:, 0::2] | (expected[:, 1::2] << 4)
        assert torch.equal(ours.view(torch.uint8).to(torch.int64), expected), name
        assert same_bytes(our_scale, halved(scale, bottom)), name
        again = dequantize_fp4(ours, our_scale, name, "ours")
        assert torch.equal(again.view(torch.int32), values.view(torch.int32)), name
    assert bottoms > 0
