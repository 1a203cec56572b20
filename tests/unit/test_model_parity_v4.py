"""Ferry's DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same checkpoints, in
float32: logits within 1e-4 of the largest, over every layer kind, both MLP kinds, prompt lengths
that cross every compression and window boundary, several seeds and a batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ferry.services.engine.model import ForwardBatch, load_model, prompt_logits
from ferry.services.engine.model.v4.compressors import Sequence
from ferry.services.engine.model.v4.config import V4ModelConfig
from tests.helpers import rel_err
from tests.helpers_v4 import CSA, HCA, SLIDING, make_v4_checkpoint, v4_hf_logits, v4_hf_model

CONFIGS: dict[str, dict[str, Any]] = {
    # the shared tiny config: sliding, CSA and HCA layers, hash then learned MoE, YaRN
    "every-kind": {},
    # a CSA layer first, hash MoE after a learned one, plain RoPE, 2 streams, 8 heads of 32
    "csa-first-plain-rope": dict(
        num_hidden_layers=3,
        layer_types=[CSA, SLIDING, HCA],
        mlp_layer_types=["moe", "hash_moe", "moe"],
        rope_parameters={"rope_type": "default"},
        num_attention_heads=8,
        head_dim=32,
        q_lora_rank=32,
        o_groups=4,
        o_lora_rank=16,
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=8,
        index_head_dim=16,
        index_topk=3,
        n_routed_experts=6,
        num_experts_per_tok=3,
        hc_mult=2,
        hc_sinkhorn_iters=7,
    ),
    # fast rates, a window wider than most prompts, 3 streams
    "fast-rates-wide-window": dict(
        num_hidden_layers=4,
        layer_types=[HCA, CSA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
        compress_rates={CSA: 2, HCA: 4},
        sliding_window=24,
        index_topk=6,
        hc_mult=3,
    ),
}

LENGTHS = [1, 3, 4, 5, 8, 16, 17, 40]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp(request.param)
    make_v4_checkpoint(path, seed=len(request.param), **CONFIGS[request.param])
    return load_model(path), v4_hf_model(path)


def test_logits_match_transformers_at_every_boundary(pair: Any) -> None:
    ours, theirs = pair
    assert isinstance(ours.config, V4ModelConfig)
    for seed in (0, 1):
        for n in LENGTHS:
            ids = _prompt(n, seed)
            err = rel_err(prompt_logits(ours, ids), v4_hf_logits(theirs, ids))
            assert err < 1e-4, f"length {n}, seed {seed}: relative error {err:.2e}"


def test_a_batch_matches_each_prompt_alone(pair: Any) -> None:
    ours, theirs = pair
    prompts = [_prompt(n, 7 + n) for n in (23, 5, 40, 1)]
    lens = [len(p) for p in prompts]
    tables = [[i] for i in range(len(prompts))]  # one 64-token block each
    cache = ours.allocate_kv_cache(len(prompts), 64, len(prompts))
    slots = list(range(len(prompts)))
    batch = ForwardBatch.build(lens, [0] * len(lens), tables, 64, "expanded", "cpu", slots)
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, batch, cache))
    start = 0
    for p in prompts:
        err = rel_err(logits[start : start + len(p)], v4_hf_logits(theirs, p))
        assert err < 1e-4, f"prompt of {len(p)} in a batch: relative error {err:.2e}"
        start += len(p)


def test_the_indexer_picks_what_transformers_picks(pair: Any) -> None:
    """Every CSA layer's top-k entry sets, per query, on a prompt with more entries than k."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    ours, theirs = pair
    seen: dict[int, tuple[Any, ...]] = {}
    hooks = []
    for i, layer in enumerate(theirs.model.layers):
        for m in layer.modules():
            if isinstance(m, DeepseekV4Indexer):

                def grab(_m: Any, args: Any, out: torch.Tensor, i: int = i) -> None:
                    seen[i] = (*args[:3], out)

                hooks.append(m.register_forward_hook(grab))
    v4_hf_logits(theirs, _prompt(61, 3))
    for h in hooks:
        h.remove()
    assert seen, "no CSA layer"
    cache = ours.allocate_kv_cache(1, 64, 1)
    for i, (x, q_residual, positions, picks) in seen.items():
        indexer = ours.model.layers[i].self_attn.compressor.indexer
        seq = Sequence(slice(0, 61), positions[0], 0, torch.tensor([0]), 0)
        with torch.inference_mode():
            mine = indexer.pick(x[0], q_residual[0], seq, cache.layer(i).indexer, ours.rope)
        assert mine.shape[1] < 61 // indexer.rate  # top-k is below the entries: it chooses
        assert torch.equal(mine.sort(-1).values, picks[0].sort(-1).values), f"layer {i}"


def test_bfloat16_keeps_transformers_float32_parameters_and_its_accuracy(
    tmp_path: Path,
) -> None:
    """In bf16 the mHC, norms, sinks and slot biases stay float32 as transformers keeps them
    (the routers too: Ferry keeps them float32); the logits are as close to float32's as
    transformers' own bf16 logits are."""
    path = make_v4_checkpoint(tmp_path, seed=5)
    ours = load_model(path, dtype=torch.bfloat16)
    theirs = v4_hf_model(path, dtype=torch.bfloat16)
    hf_dtypes = dict((n, p.dtype) for n, p in theirs.named_parameters())
    for name, p in ours.named_parameters():
        if name in hf_dtypes and not name.endswith("mlp.gate.weight"):
            assert p.dtype == hf_dtypes[name], name
    assert ours.model.layers[0].attn_hc.fn.dtype == torch.float32
    assert ours.model.layers[0].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    ids = _prompt(40, 9)
    exact = prompt_logits(load_model(path), ids)
    ours_err = rel_err(prompt_logits(ours, ids), exact)
    theirs_err = rel_err(v4_hf_logits(theirs, ids), exact)
    assert ours_err < max(1.5 * theirs_err, 1e-2), (ours_err, theirs_err)
