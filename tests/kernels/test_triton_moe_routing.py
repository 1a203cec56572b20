"""moe_route and expert_counts: Triton (interpreted) against the torch reference.

The reference picks with ``topk(sorted=False)``, so choices are compared as sets (ids sorted, the
weights permuted alike); the inputs are random floats, so there are no ties to break.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton

# (num_tokens, num_experts, n_group, topk_group, top_k, bias, renormalize)
CASES = [
    (37, 16, 4, 2, 4, True, True),  # more tokens than one program's block
    (5, 8, 1, 1, 3, False, True),  # no groups, no correction bias
    (9, 12, 3, 2, 2, True, False),  # experts and groups not powers of two, no renormalisation
    (20, 256, 8, 4, 8, True, True),  # DeepSeek-V3
]


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-G{c[2]}")
def test_moe_route(case: tuple[int, int, int, int, int, bool, bool]) -> None:
    tokens, experts, n_group, topk_group, top_k, with_bias, renormalize = case
    gen = generator(tokens)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.1 if with_bias else None
    args = (logits, bias, top_k, n_group, topk_group, renormalize, 2.5)
    weights, ids = _by_id(*triton("moe_route", *args))
    ref_weights, ref_ids = _by_id(*torch_ref("moe_route", *args))
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    assert_matches(weights, ref_weights, torch.float32)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
def test_moe_route_scoring(scoring: str) -> None:
    """DeepSeek-V4's sqrt(softplus) scores (logits past softplus's linear threshold included)."""
    gen = generator(11)
    logits = torch.randn(23, 16, generator=gen) * 12
    bias = torch.randn(16, generator=gen) * 0.1
    args = (logits, bias, 6, 1, 1, True, 1.5, scoring)
    weights, ids = _by_id(*triton("moe_route", *args))
    ref_weights, ref_ids = _by_id(*torch_ref("moe_route", *args))
    assert torch.equal(ids, ref_ids)
    assert_matches(weights, ref_weights, torch.float32)


def test_moe_route_no_tokens() -> None:
    weights, ids = triton("moe_route", torch.empty(0, 16), None, 4, 4, 2, True, 1.0)
    assert weights.shape == ids.shape == (0, 4)


@pytest.mark.parametrize("shape", [(33, 3), (1, 1), (700, 8)])
def test_expert_counts(shape: tuple[int, int]) -> None:
    ids = torch.randint(-1, 10, shape, generator=generator(shape[0]))  # -1: not counted
    counts = triton("expert_counts", ids, 12)  # experts 10 and 11: nobody
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch_ref("expert_counts", ids, 12))
    assert int(counts.sum()) == int((ids >= 0).sum()) and counts[10:].sum() == 0
