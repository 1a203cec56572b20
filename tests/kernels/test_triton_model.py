"""The tiny preset's logits with every op on the Triton kernels (interpreted) equal the torch
path's: a prefill (expanded attention) then token-by-token decode (absorbed attention)."""

from __future__ import annotations

import torch

from ferry.kernels import dispatch
from ferry.services.engine.model import DeepseekV3ForCausalLM, ForwardBatch, load_model
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
