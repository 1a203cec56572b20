"""The torch reference ops against direct, slow formulations, and the dispatch point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ferry import kernels as ops
from ferry.kernels import dispatch
from ferry.kernels.mla_decode.reference import length_groups, mla_decode_torch


def test_moe_route_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 16, generator=gen) * 2
    bias = torch.randn(16, generator=gen) * 0.1
    weights, ids = ops.moe_route(logits, bias, 4, 4, 2, True, 2.5)
    scores = logits.sigmoid()
    for t in range(50):
        choice = scores[t] + bias
        groups = choice.view(4, 4).topk(2, dim=-1).values.sum(-1).topk(2).indices.tolist()
        allowed = [e for e in range(16) if e // 4 in groups]
        best = sorted(allowed, key=lambda e: -float(choice[e]))[:4]
        assert sorted(ids[t].tolist()) == sorted(best)
        w = scores[t, ids[t]]
        torch.testing.assert_close(weights[t], w / w.sum() * 2.5)


def test_fused_moe_matches_per_token_loop_and_skips_remote_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden, inter, slots = 24, 8, 6
    x = torch.randn(10, hidden, generator=gen)
    w13 = torch.randn(slots, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(slots, hidden, inter, generator=gen) * 0.2
    topk = torch.randint(-1, slots, (10, 3), generator=gen)  # -1: expert lives on another rank
    weights = torch.rand(10, 3, generator=gen)
    out = ops.fused_moe(x, w13, w2, weights, topk)
    expect = torch.zeros_like(x)
    for t in range(10):
        for k in range(3):
            s = int(topk[t, k])
            if s < 0:
                continue
            gate, up = (w13[s] @ x[t]).chunk(2)
            expect[t] += weights[t, k] * (w2[s] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    assert ops.fused_moe(x[:0], w13, w2, weights[:0], topk[:0]).shape == (0, hidden)


def test_mla_decode_ragged_lengths() -> None:
    gen = torch.Generator().manual_seed(2)
    heads, rank, rope, bs = 4, 16, 8, 8
    cache = torch.randn(12, bs, rank + rope, generator=gen)
    q = torch.randn(3, heads, rank + rope, generator=gen)
    tables = torch.tensor([[3, 7, -1], [0, 1, 2], [11, -1, -1]])
    lens = torch.tensor([9, 24, 1])
    out = mla_decode_torch(q, cache, tables, lens, 0.3, rank)
    for b in range(3):
        kv = cache[tables[b][tables[b] >= 0]].reshape(-1, rank + rope)[: lens[b]]
        p = torch.softmax(q[b] @ kv.T * 0.3, dim=-1)
        torch.testing.assert_close(out[b], p @ kv[:, :rank])


def test_mla_decode_attends_in_groups_of_like_lengths() -> None:
    """Short contexts beside long ones are attended apart (each group gathered up to its own
    longest), in and out of a compiled graph, with the brute-force result either way."""
    assert length_groups([100] * 6) == [[0, 1, 2, 3, 4, 5]]
    assert length_groups([4000, 8, 3990, 9, 4000, 7]) == [[5, 1, 3], [2, 0, 4]]
    assert length_groups([]) == []
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope, bs = 4, 16, 8, 8
    cache = torch.randn(200, bs, rank + rope, generator=gen)
    lens = torch.tensor([640, 1, 600, 2])
    assert len(length_groups(lens.tolist())) == 2
    tables = torch.arange(4 * 80).view(4, 80) % 200
    q = torch.randn(4, heads, rank + rope, generator=gen)
    want = torch.stack(
        [
            torch.softmax(
                q[b] @ (kv := cache[tables[b]].reshape(-1, rank + rope)[: lens[b]]).T * 0.3, -1
            )
            @ kv[:, :rank]
            for b in range(4)
        ]
    )
    torch.testing.assert_close(mla_decode_torch(q, cache, tables, lens, 0.3, rank), want)
    compiled = torch.compile(mla_decode_torch, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(q, cache, tables, lens, 0.3, rank), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_len", "ctx_len"), [(7, 7), (5, 40), (33, 34), (1, 9)])
def test_prefill_attention_is_causal_after_the_cached_prefix(
    q_len: int, ctx_len: int, dtype: torch.dtype
) -> None:
    """A chunk of q_len queries at the end of ctx_len positions (MLA's 48-wide keys, 32-wide
    values), against the masked softmax written out."""
    gen = torch.Generator().manual_seed(q_len * 100 + ctx_len)
    q = torch.randn(4, q_len, 48, generator=gen)
    k = torch.randn(4, ctx_len, 48, generator=gen)
    v = torch.randn(4, ctx_len, 32, generator=gen)
    out = ops.prefill_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.2)
    scores = torch.einsum("hqd,hkd->hqk", q, k) * 0.2
    visible = torch.arange(ctx_len)[None, :] <= torch.arange(ctx_len - q_len, ctx_len)[:, None]
    want = torch.einsum("hqk,hkd->qhd", scores.masked_fill(~visible, -torch.inf).softmax(-1), v)
    assert out.dtype == dtype and out.shape == (q_len, 4, 32)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_mla_decode_in_and_out_of_inference_mode_on_one_thread() -> None:
    """The decode gather reuses a per-thread buffer; an engine step (inference_mode) and plain
    code on the same thread must both be able to use it."""
    cache, q = torch.randn(4, 512, 24), torch.randn(1, 2, 24)  # larger than other tests' gathers
    tables, lens = torch.tensor([[2, 0, 3, 1]]), torch.tensor([2000])
    with torch.inference_mode():  # the buffer is (re)made here
        inside = mla_decode_torch(q, cache, tables, lens, 0.3, 16)
    torch.testing.assert_close(mla_decode_torch(q, cache, tables, lens, 0.3, 16), inside)
    with torch.inference_mode():
        torch.testing.assert_close(mla_decode_torch(q, cache, tables, lens, 0.3, 16), inside)


def test_every_op_has_a_torch_reference() -> None:
    for op in (
        "rms_norm",
        "add_rms_norm",
        "moe_route",
        "fused_moe",
        "mla_decode",
        "prefill_attention",
    ):
        assert "torch" in dispatch.implementations(op), op


def test_dispatch_override() -> None:
    dispatch.register("test_only_op", "torch")(lambda x: x + 1)
    x = torch.zeros(2)
    assert dispatch.resolve("test_only_op", x.device)(x).tolist() == [1.0, 1.0]
    try:
        dispatch.set_backend("triton")
        with pytest.raises(RuntimeError, match="'test_only_op' has no 'triton' implementation"):
            dispatch.resolve("test_only_op", x.device)
    finally:
        dispatch.set_backend("auto")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        dispatch.set_backend("cuda")


def test_bad_ferry_kernels_env_fails_at_import() -> None:
    env = {**os.environ, "FERRY_KERNELS": "cuda"}
    run = subprocess.run(
        [sys.executable, "-c", "import ferry.kernels"], env=env, capture_output=True, text=True
    )
    assert run.returncode != 0 and "FERRY_KERNELS='cuda'" in run.stderr
