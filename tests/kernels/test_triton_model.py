"""The presets' logits with every op on the Triton kernels (interpreted) equal the torch path's:
a prefill, then token-by-token decode. ``tiny`` (DeepSeek-V3: expanded, then absorbed MLA) and
``v4-tiny`` (DeepSeek-V4: sparse attention, compressor pooling and the indexer)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ferry.kernels import dispatch
from ferry.services.engine.model import ForwardBatch, MoECausalLM, load_model
from tests.kernels.triton_helpers import rel_err

pytestmark = pytest.mark.slow  # ~40 s under the interpreter: `make test-slow`

BLOCK_SIZE, TABLE = 16, [3, 0, 2]
V3_OPS = ("rms_norm", "add_rms_norm", "moe_route", "fused_moe", "mla_decode", "prefill_attention")
V4_OPS = ("sparse_mqa", "compress_pool", "indexer_topk", "moe_route", "fused_moe")


@torch.inference_mode()
def _logits(model: MoECausalLM, ids: list[int], prefill: int) -> torch.Tensor:
    stateful = bool(model.cache_spec().rings)
    cache = model.allocate_kv_cache(4, BLOCK_SIZE, 1 if stateful else 0)
    build: dict[str, Any] = {"attention": "expanded", "state_slots": [0]} if stateful else {}

    def step(n: int, done: int) -> ForwardBatch:
        return ForwardBatch.build([n], [done], [TABLE], BLOCK_SIZE, **build)

    rows = [model.compute_logits(model(torch.tensor(ids[:prefill]), step(prefill, 0), cache))]
    for pos in range(prefill, len(ids)):
        rows.append(model.compute_logits(model(torch.tensor([ids[pos]]), step(1, pos), cache)))
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("preset", "length", "prefill", "ops"),
    [
        ("tiny", 24, 20, V3_OPS),
        # v4-tiny: a window of 32 crossed, 9 CSA entries of which its indexer keeps 8, 2 HCA
        ("v4-tiny", 44, 37, V4_OPS),
    ],
)
def test_model_logits_triton_equal_torch(
    preset: str, length: int, prefill: int, ops: tuple[str, ...]
) -> None:
    model = load_model(preset)
    gen = torch.Generator().manual_seed(len(preset))
    ids = torch.randint(0, 256, (length,), generator=gen).tolist()
    try:
        dispatch.set_backend("torch")
        expect = _logits(model, ids, prefill)
        dispatch.set_backend("triton")
        got = _logits(model, ids, prefill)
    finally:
        dispatch.set_backend("auto")
    assert all("triton" in dispatch.implementations(op) for op in ops)  # they really ran
    assert rel_err(got, expect) < 1e-4
