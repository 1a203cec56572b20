"""mla_decode: the split-K Triton kernels (interpreted) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.mla_decode.triton_kernel import DecodeBlocks
from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton


def _paged(
    lens: list[int], heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """A cache of scattered blocks (shuffled, -1 padded tables) holding ragged contexts."""
    gen = generator(sum(lens) + heads)
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, rank + rope, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.long)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[start : start + n])
        start += n
    return q, cache, tables, torch.tensor(lens)


# (seq_lens, heads, kv_lora_rank, rope_dim, block_size, softmax_scale)
# NOTE: the reference rounds bfloat16 scores to bfloat16 before the softmax; with DeepSeek-V3's
# dims it stays within 1e-2 of the kernel at the model's own scale (qk_head_dim 192 ** -0.5), the
# kernel being the closer of the two to a float32 computation.
CASES = [
    ([9, 30, 1], 4, 16, 8, 8, 0.3),  # ragged, a one-token context
    ([64, 17], 20, 24, 8, 16, 0.3),  # two head blocks; rank not a power of two; a full last block
    ([40], 16, 512, 64, 16, 192**-0.5),  # DeepSeek-V3's latent and rope dims
]


@pytest.mark.parametrize("splits", [1, 3, None], ids=["1split", "3splits", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}-h{c[1]}-r{c[2]}")
def test_mla_decode(
    case: tuple[list[int], int, int, int, int, float], dtype: torch.dtype, splits: int | None
) -> None:
    lens, heads, rank, rope, block_size, scale = case
    q, cache, tables, seq_lens = _paged(lens, heads, rank, rope, block_size, dtype)
    blocks = DecodeBlocks(block_n=16, num_splits=splits)
    out = triton("mla_decode", q, cache, tables, seq_lens, scale, rank, blocks=blocks)
    assert_matches(out, torch_ref("mla_decode", q, cache, tables, seq_lens, scale, rank), dtype)


def test_more_splits_than_tokens() -> None:
    """Splits with nothing to read (m = -inf) must drop out of the merge."""
    q, cache, tables, seq_lens = _paged([2, 5], 4, 16, 8, 4, torch.float32)
    out = triton(
        "mla_decode", q, cache, tables, seq_lens, 0.5, 16, blocks=DecodeBlocks(num_splits=4)
    )
    assert_matches(out, torch_ref("mla_decode", q, cache, tables, seq_lens, 0.5, 16), torch.float32)
