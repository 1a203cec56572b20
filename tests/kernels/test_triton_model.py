"""The tiny preset's logits with every op on the Triton kernels (interpreted) equal the torch
path's: a prefill (expanded attention) then token-by-token decode (absorbed attention)."""

from __future__ import annotations

import torch

from ferry.kernels import dispatch
from ferry.services.engine.model import (
    DeepseekV3ForCausalLM,
    ForwardBatch,
    MoECausalLM,
    load_model,
)
from tests.kernels.triton_helpers import rel_err

OPS = ("rms_norm", "add_rms_norm", "moe_route", "fused_moe", "mla_decode", "prefill_attention")


@torch.inference_mode()
def _logits(model: DeepseekV3ForCausalLM, ids: list[int], prefill: int) -> torch.Tensor:
    block_size, table = 16, [3, 0, 2]
    cache = model.allocate_kv_cache(4, block_size)
    step = ForwardBatch.build([prefill], [0], [table], block_size)
    rows = [model.compute_logits(model(torch.tensor(ids[:prefill]), step, cache))]
    for pos in range(prefill, len(ids)):
        step = ForwardBatch.build([1], [pos], [table], block_size)
        rows.append(model.compute_logits(model(torch.tensor([ids[pos]]), step, cache)))
    return torch.cat(rows)


def test_tiny_model_logits_triton_equal_torch() -> None:
    model = load_model("tiny")
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        dispatch.set_backend("torch")
        expect = _logits(model, ids, prefill=20)
        dispatch.set_backend("triton")
        got = _logits(model, ids, prefill=20)
    finally:
        dispatch.set_backend("auto")
    assert all("triton" in dispatch.implementations(op) for op in OPS)  # they really ran
    assert rel_err(got, expect) < 1e-4


V4_OPS = ("sparse_mqa", "compress_pool", "indexer_topk", "moe_route", "fused_moe")


@torch.inference_mode()
def _v4_logits(model: MoECausalLM, ids: list[int], prefill: int) -> torch.Tensor:
    """A prefill chunk, then one token at a time: the batched decode path."""
    block_size, table = 16, [2, 0, 3]
    cache = model.allocate_kv_cache(4, block_size, 1)
    step = ForwardBatch.build([prefill], [0], [table], block_size, "expanded", state_slots=[0])
    rows = [model.compute_logits(model(torch.tensor(ids[:prefill]), step, cache))]
    for pos in range(prefill, len(ids)):
        step = ForwardBatch.build([1], [pos], [table], block_size, "expanded", state_slots=[0])
        rows.append(model.compute_logits(model(torch.tensor([ids[pos]]), step, cache)))
    return torch.cat(rows)


def test_v4_tiny_logits_triton_equal_torch() -> None:
    """DeepSeek-V4's sparse attention, compressor pooling and indexer on their kernels: CSA
    entries picked by the indexer, HCA entries, windows crossed, prefill and decode."""
    model = load_model("v4-tiny")
    ids = torch.randint(0, 256, (44,), generator=torch.Generator().manual_seed(1)).tolist()
    try:
        dispatch.set_backend("torch")
        expect = _v4_logits(model, ids, prefill=37)
        dispatch.set_backend("triton")
        got = _v4_logits(model, ids, prefill=37)
    finally:
        dispatch.set_backend("auto")
    assert all("triton" in dispatch.implementations(op) for op in V4_OPS)
    assert rel_err(got, expect) < 1e-4
