"""compress_pool: the gated pooling Triton kernel (interpreted) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import ferry.kernels.v4_compress  # noqa: F401 (registers the op)
from ferry.kernels.v4_compress.triton_kernel import PoolBlocks
from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton


def _inputs(
    entries: int, rows: int, width: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv and gate as the two halves of one projection (views with a row stride of 2 x width),
    some rows of the gate hidden (-inf), never all of an entry's rows."""
    gen = generator(seed)
    both = torch.randn(entries, rows, 2 * width, generator=gen).to(dtype)
    kv, gate = both[..., :width], both[..., width:]
    hidden = torch.rand(entries, rows, 1, generator=gen) < 0.3
    hidden[:, 0] = False
    return kv, gate.masked_fill(hidden, float("-inf"))


# (entries, rows, width, blocks)
CASES = [
    (5, 8, 48, None),  # CSA's rows; width not a power of two
    (3, 128, 40, None),  # HCA's rows
    (4, 5, 70, PoolBlocks(tile=64)),  # rows not a power of two; three channel blocks
    (3, 37, 33, PoolBlocks(block_r=8, tile=256)),  # rows in 5 tiles, read twice
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-r{c[1]}-w{c[2]}")
def test_compress_pool(case: tuple[int, int, int, PoolBlocks | None], dtype: torch.dtype) -> None:
    entries, rows, width, blocks = case
    kv, gate = _inputs(entries, rows, width, dtype, seed=entries * rows + width)
    out = triton("compress_pool", kv, gate, blocks=blocks)
    assert_matches(out, torch_ref("compress_pool", kv, gate), dtype)


def test_float32_gate_with_bfloat16_kv_and_a_transposed_view() -> None:
    """The gate in float32 over bfloat16 rows; kv strided along its width (copied once)."""
    gen = generator(5)
    kv = torch.randn(6, 24, 8, generator=gen).to(torch.bfloat16).transpose(1, 2)  # [6, 8, 24]
    gate = torch.randn(6, 8, 24, generator=gen)
    out = triton("compress_pool", kv, gate)
    assert_matches(out, torch_ref("compress_pool", kv, gate), torch.bfloat16)


def test_a_channel_hidden_in_every_tile_but_one() -> None:
    """Tiles of a channel that are all -inf before and after its one visible row."""
    gen = generator(9)
    kv = torch.randn(2, 20, 16, generator=gen)
    gate = torch.full((2, 20, 16), float("-inf"))
    gate[0, 13] = torch.randn(16, generator=gen)
    gate[1, 2:6] = torch.randn(4, 16, generator=gen)
    out = triton("compress_pool", kv, gate, blocks=PoolBlocks(block_r=4))
    assert_matches(out, torch_ref("compress_pool", kv, gate), torch.float32)
    torch.testing.assert_close(out[0], kv[0, 13])


def test_empty() -> None:
    kv = torch.randn(0, 8, 16)
    assert triton("compress_pool", kv, kv).shape == (0, 16)
    kv = torch.randn(3, 0, 16)
    assert triton("compress_pool", kv, kv).abs().max() == 0
