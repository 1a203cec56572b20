"""Ferry's DeepSeek-V3 against transformers' DeepseekV3ForCausalLM on the same checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferry.services.engine.model import load_model, prompt_logits
from tests.helpers import YARN, hf_logits, make_hf_checkpoint, rel_err, rewrite_config

# Together these cover q_lora on/off, YaRN on/off, first_k_dense_replace 0 and >0,
# norm_topk_prob on/off, n_group 1 and >1, rope_interleave on/off.
CONFIGS = {
    "qlora-yarn-grouped-interleave": dict(
        q_lora_rank=24,
        rope_parameters=YARN,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        n_group=4,
        topk_group=2,
        rope_interleave=True,
    ),
    "noqlora-plain-ungrouped-halfsplit": dict(
        q_lora_rank=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        first_k_dense_replace=0,
        norm_topk_prob=False,
        n_group=1,
        topk_group=1,
        rope_interleave=False,
    ),
    "qlora-plain-twodense-halfsplit": dict(
        q_lora_rank=24,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        first_k_dense_replace=2,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        rope_interleave=False,
    ),
    "noqlora-yarn-mscale-grouped": dict(
        q_lora_rank=None,
        rope_parameters={**YARN, "mscale": 0.8, "mscale_all_dim": 0.6},
        first_k_dense_replace=0,
        norm_topk_prob=False,
        n_group=2,
        topk_group=1,
        rope_interleave=True,
    ),
}

PROMPT_LENS = [1, 7, 64, 65, 300]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(path, seed=len(request.param), **CONFIGS[request.param])


def test_logits_match_transformers(checkpoint: Path) -> None:
    ours = load_model(checkpoint)
    for n in PROMPT_LENS:
        ids = _prompt(n, n)
        err = rel_err(prompt_logits(ours, ids), hf_logits(checkpoint, ids))
        assert err < 1e-4, f"{checkpoint.name} len={n}: relative error {err:.2e}"


def test_deepseek_spelling_of_config(checkpoint: Path, tmp_path: Path) -> None:
    """The same weights with config.json as DeepSeek ships it (rope_scaling, rope_theta on top,
    scoring_func, topk_method) give the same logits."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    rewrite_config(
        tmp_path,
        rope_parameters=None,
        rope_theta=theta,
        rope_scaling=None if kind == "default" else {"type": kind, **rope},
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    ids = _prompt(50, 3)
    a = prompt_logits(load_model(checkpoint), ids)
    b = prompt_logits(load_model(tmp_path), ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bfloat16_close_to_float32(checkpoint: Path) -> None:
    ids = _prompt(40, 5)
    ref = prompt_logits(load_model(checkpoint), ids)
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    routers = [n for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(model.get_parameter(n).dtype == torch.float32 for n in routers)
    bf16 = prompt_logits(model, ids)
    assert bf16.dtype == torch.float32
    # bfloat16 may flip a near-tied expert choice, so compare the logits as a whole.
    cos = torch.nn.functional.cosine_similarity(bf16.flatten(), ref.flatten(), dim=0)
    assert cos > 0.98, f"cosine similarity {cos:.4f}"


def test_exported_preset_matches_transformers(tmp_path: Path) -> None:
    from ferry.services.engine.model import export_preset

    export_preset("tiny", tmp_path)
    ids = _prompt(90, 9)
    ours_ckpt = prompt_logits(load_model(tmp_path), ids)
    ours_preset = prompt_logits(load_model("tiny"), ids)
    torch.testing.assert_close(ours_ckpt, ours_preset, rtol=0, atol=0)
    assert rel_err(ours_ckpt, hf_logits(tmp_path, ids)) < 1e-4
