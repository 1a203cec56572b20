"""sparse_mqa: the gathered-rows Triton kernel (interpreted) against the torch reference, and
against dense attention with sinks over a mask when the indices name exactly the keys the mask
leaves visible."""

from __future__ import annotations

import pytest
import torch

import ferry.kernels.sparse_mqa  # noqa: F401 (registers it)
from ferry.kernels.sparse_mqa.triton_kernel import SparseBlocks
from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton

BLOCKS = SparseBlocks(block_h=16, block_k=16)


def _inputs(
    queries: int, heads: int, dim: int, rows: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """Random q, kv, sinks and indices: distinct rows per query, a random number of them valid
    (some queries none), the rest -1, shuffled so that -1 sits anywhere in a row."""
    gen = generator(seed)
    q = torch.randn(queries, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(rows, dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    indices = torch.full((queries, k), -1, dtype=torch.long)
    for t in range(queries):
        n = int(torch.randint(0, min(k, rows) + 1, (1,), generator=gen))
        n = 0 if t == 1 else n  # query 1 has no index
        chosen = torch.randperm(rows, generator=gen)[:n]
        indices[t, torch.randperm(k, generator=gen)[:n]] = chosen
    return q, kv, indices, sinks


# (queries, heads, dim, kv rows, k, softmax_scale)
CASES = [
    (4, 16, 32, 40, 24, 0.3),  # k not a multiple of the 16-row tile
    (3, 20, 40, 50, 33, 0.2),  # two head blocks, the second partial; dim not a power of two
    (2, 64, 512, 80, 48, 512**-0.5),  # V4-Flash's heads and head_dim
]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-h{c[1]}-d{c[2]}-k{c[4]}")
def test_sparse_mqa(
    case: tuple[int, int, int, int, int, float], dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    queries, heads, dim, rows, k, scale = case
    q, kv, indices, sinks = _inputs(queries, heads, dim, rows, k, dtype, seed=sum(case[:5]))
    indices = indices.to(index_dtype)
    out = triton("sparse_mqa", q, kv, indices, sinks, scale, blocks=BLOCKS)
    ref = torch_ref("sparse_mqa", q, kv, indices, sinks, scale)
    assert_matches(out, ref, dtype)
    assert out[1].abs().max() == 0  # no index: the sink takes the whole weight


def test_default_blocks_and_strided_inputs() -> None:
    """The default tiling; q a strided view (heads of a wider tensor), indices a column slice."""
    gen = generator(7)
    wide = torch.randn(3, 8, 2, 24, generator=gen)
    q = wide[:, :, 0]
    kv = torch.randn(70, 24, generator=gen)
    sinks = torch.randn(8, generator=gen)
    indices = torch.randint(-1, 70, (3, 90), generator=gen)[:, 5:75]
    out = triton("sparse_mqa", q, kv, indices, sinks, 0.4)
    assert_matches(out, torch_ref("sparse_mqa", q, kv, indices, sinks, 0.4), torch.float32)


def test_no_indices_at_all() -> None:
    gen = generator(3)
    q, kv = torch.randn(2, 4, 16, generator=gen), torch.randn(5, 16, generator=gen)
    indices = torch.empty(2, 0, dtype=torch.long)
    out = triton("sparse_mqa", q, kv, indices, torch.randn(4, generator=gen), 0.5, blocks=BLOCKS)
    assert out.shape == (2, 4, 16) and out.abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_masked_attention_on_the_visible_keys(dtype: torch.dtype) -> None:
    """A causal sliding window over a shared kv: dense attention with a sink column and the
    window as its mask, sparse_mqa with the window's key ids as its indices (padded with -1)."""
    queries, heads, dim, window = 6, 16, 48, 4
    gen = generator(11)
    q = torch.randn(queries, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(queries, dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    pos = torch.arange(queries)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    bias = torch.zeros(queries, queries).masked_fill(~visible, float("-inf"))
    indices = torch.full((queries, 2 * window), -1, dtype=torch.long)
    for t in range(queries):
        ids = visible[t].nonzero().flatten()
        indices[t, 1 : 1 + len(ids)] = ids.flip(0)
    scale = dim**-0.5
    out = triton("sparse_mqa", q, kv, indices, sinks, scale, blocks=BLOCKS)
    assert_matches(out, _masked(q, kv, bias, sinks, scale), dtype)


def _masked(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax([q·kvᵀ·scale + bias | sink]) without the sink column, times kv, in float32."""
    logits = torch.einsum("thd,sd->ths", q.float(), kv.float()) * scale + bias[:, None, :]
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", probs, kv.float()).to(q.dtype)
