"""prefill_attention: the causal flash-attention kernel (interpreted) against the torch one."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_helpers import assert_matches, generator, torch_ref, triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len, ctx_len", [(70, 70), (5, 133), (1, 9)])
def test_prefill_attention(q_len: int, ctx_len: int, dtype: torch.dtype) -> None:
    """Queries as the model passes them: [heads, q_len, dim] views of [q_len, heads, dim]."""
    gen = generator(q_len + ctx_len)
    q = torch.randn(q_len, 3, 24, generator=gen).to(dtype).transpose(0, 1)
    k = torch.randn(ctx_len, 3, 24, generator=gen).to(dtype).transpose(0, 1)
    v = torch.randn(ctx_len, 3, 12, generator=gen).to(dtype).transpose(0, 1)
    out = triton("prefill_attention", q, k, v, 0.3)
    assert_matches(out, torch_ref("prefill_attention", q, k, v, 0.3), dtype)
