"""The two MLA attention paths (expanded for prefill, absorbed for decode) on one paged cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry.services.engine.model import (
    DeepseekV3ForCausalLM,
    ForwardBatch,
    load_model,
    prompt_logits,
)
from tests.helpers import YARN, Checkpoint, rel_err

CHECKPOINT = Checkpoint(
    seed=7,
    config={
        "q_lora_rank": 24,
        "rope_parameters": YARN,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
    },
)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> DeepseekV3ForCausalLM:
    return load_model(checkpoint)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def test_absorbed_equals_expanded_on_same_cache(model: DeepseekV3ForCausalLM) -> None:
    """Three sequences with cached prefixes in scattered blocks, then one step of new tokens run
    once per path on copies of the same cache."""
    bs = 16
    prefix_lens, new_lens = [40, 3, 70], [1, 9, 33]
    rng = torch.Generator().manual_seed(0)
    order = torch.randperm(64, generator=rng).tolist()
    tables = [order[0:8], order[8:16], order[16:24]]
    cache = model.allocate_kv_cache(64, bs)
    prompts = [_ids(p + n, i) for i, (p, n) in enumerate(zip(prefix_lens, new_lens, strict=True))]
    warm = ForwardBatch.build(prefix_lens, [0, 0, 0], tables, bs, "expanded")
    model(
        torch.tensor([t for p, n in zip(prompts, prefix_lens, strict=True) for t in p[:n]]),
        warm,
        cache,
    )

    new_ids = torch.tensor([t for p, n in zip(prompts, prefix_lens, strict=True) for t in p[n:]])
    outs = {}
    for path in ("expanded", "absorbed"):
        step = ForwardBatch.build(new_lens, prefix_lens, tables, bs, path)
        outs[path] = model.compute_logits(model(new_ids, step, cache.clone()))
    assert rel_err(outs["absorbed"], outs["expanded"]) < 1e-5


@torch.inference_mode()
def test_token_by_token_decode_matches_prompt_logits(model: DeepseekV3ForCausalLM) -> None:
    """Prefill 20 tokens, then decode one token per step (the absorbed path) through a
    non-contiguous block table; every position matches the full-prompt logits."""
    ids = _ids(75, 11)
    bs, prefill = 16, 20
    table = [9, 2, 7, 0, 5]
    cache = model.allocate_kv_cache(10, bs)
    step = ForwardBatch.build([prefill], [0], [table], bs)
    rows = [model.compute_logits(model(torch.tensor(ids[:prefill]), step, cache))]
    for pos in range(prefill, len(ids)):
        step = ForwardBatch.build([1], [pos], [table], bs)
        assert step.decode is not None and not step.prefill  # auto picks the absorbed path
        rows.append(model.compute_logits(model(torch.tensor([ids[pos]]), step, cache)))
    assert rel_err(torch.cat(rows), prompt_logits(model, ids)) < 1e-5


def test_block_size_does_not_change_logits(model: DeepseekV3ForCausalLM) -> None:
    ids = _ids(130, 4)
    ref = prompt_logits(model, ids, block_size=64)
    for bs in (16, 256):
        assert rel_err(prompt_logits(model, ids, block_size=bs), ref) < 1e-6


def test_prompt_logits_rejects_bad_input(model: DeepseekV3ForCausalLM) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        prompt_logits(model, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prompt_logits(model, [1, 384])


def test_forward_batch_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="needs more than 1 blocks"):
        ForwardBatch.build([20], [0], [[0]], 16)


def test_kv_cache_layout(model: DeepseekV3ForCausalLM) -> None:
    assert model.config.kv_cache_dim == 32 + 8
    assert model.allocate_kv_cache(3, 16).shape == (3, 3, 16, 40)
