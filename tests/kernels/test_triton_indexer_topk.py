"""indexer_topk: the scoring + top-k Triton kernel (interpreted) against the torch reference.
Ties may come out in any order, so picks are compared by their scores, and as sets of ids."""

from __future__ import annotations

import pytest
import torch

import ferry.kernels.indexer_topk  # noqa: F401 (registers the op)
from ferry.kernels.indexer_topk.triton_kernel import IndexerBlocks
from tests.kernels.triton_helpers import generator, torch_ref, triton


def _inputs(
    n: int, heads: int, dim: int, entries: int, shared: bool, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = generator(seed)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(n, heads, generator=gen)
    shape = (entries, dim) if shared else (n, entries, dim)
    return q, weights, torch.randn(*shape, generator=gen).to(dtype)


def _scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[n, entries] float64: every entry's score, visible or not."""
    pattern = "nhd,ed->nhe" if keys.dim() == 2 else "nhd,ned->nhe"
    dots = torch.einsum(pattern, q.double(), keys.double()).relu() * q.shape[-1] ** -0.5
    return (dots * weights.double()[:, :, None]).sum(dim=1)


def _check(
    ids: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    num_visible: torch.Tensor,
    k: int,
) -> None:
    ref = torch_ref("indexer_topk", q, weights, keys, num_visible, k)
    assert ids.shape == ref.shape and ids.dtype == ref.dtype
    scores = _scores(q, weights, keys)
    for t in range(ids.shape[0]):
        seen = min(int(num_visible[t]), keys.shape[-2])
        kept = min(seen, k)
        assert (ids[t, kept:] == -1).all(), (t, ids[t])
        picks = ids[t, :kept]
        assert ((picks >= 0) & (picks < seen)).all() and len(set(picks.tolist())) == kept, t
        ours, best = scores[t, picks], scores[t, ref[t, :kept]]
        tol = 1e-5 * float(scores[t].abs().max()) + 1e-12
        assert (ours[1:] <= ours[:-1] + tol).all(), f"query {t}: not best first"
        assert torch.allclose(ours, best.sort(descending=True).values, rtol=0, atol=tol), t
        # The same set, unless the k-th and the next best are too close to call.
        rest = scores[t, :seen].sort(descending=True).values
        if kept == seen or rest[kept - 1] - rest[kept] > tol:
            assert picks.sort().values.tolist() == ref[t, :kept].sort().values.tolist(), t


# (n, heads, dim, entries, k, shared, num_visible, blocks)
CASES = [
    (5, 8, 32, 100, 16, True, [0, 10, 16, 100, 150], None),  # k > visible; more than entries
    (4, 20, 24, 90, 12, False, [90, 3, 45, 77], None),  # per query; k, heads, dim not pow2
    (3, 6, 16, 150, 40, True, [150, 41, 99], IndexerBlocks(block_e=16)),  # 4 dots a chunk
    (3, 6, 16, 50, 5, False, [50, 17, 1], IndexerBlocks(block_e=16)),  # k < the dot's block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-h{c[1]}-e{c[3]}-k{c[4]}-s{c[5]:d}")
def test_indexer_topk(
    case: tuple[int, int, int, int, int, bool, list[int], IndexerBlocks | None],
    dtype: torch.dtype,
) -> None:
    n, heads, dim, entries, k, shared, visible, blocks = case
    q, weights, keys = _inputs(n, heads, dim, entries, shared, dtype, seed=entries + k)
    num_visible = torch.tensor(visible)
    ids = triton("indexer_topk", q, weights, keys, num_visible, k, blocks=blocks)
    _check(ids, q, weights, keys, num_visible, k)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_query"])
def test_v4_flash_shapes(shared: bool) -> None:
    """64 index heads of dim 128 choosing 512 of 1300 entries (three chunks), int32 counts."""
    q, weights, keys = _inputs(2, 64, 128, 1300, shared, torch.bfloat16, seed=int(shared))
    num_visible = torch.tensor([1300, 700], dtype=torch.int32)
    ids = triton("indexer_topk", q, weights, keys, num_visible, 512)
    _check(ids, q, weights, keys, num_visible, 512)


def test_ties_and_negative_scores() -> None:
    """Equal and negative scores (weights of both signs, q of one head): every pick's score
    still matches the reference's k best."""
    gen = generator(4)
    q = torch.randn(2, 1, 16, generator=gen)
    weights = torch.tensor([[-1.0], [2.0]])
    keys = torch.randn(60, 16, generator=gen)
    num_visible = torch.tensor([60, 60])
    ids = triton("indexer_topk", q, weights, keys, num_visible, 32)
    _check(ids, q, weights, keys, num_visible, 32)
