"""V4ModelConfig reads both spellings of a DeepSeek-V4 config.json as transformers'
DeepseekV4Config does (the parity oracle), and writes one it reads back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import DeepseekV4Config

from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.loader import read_config
from ferry.services.engine.model.registry import config_from_hf_dict
from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v4.config import CSA, HCA, SLIDING, V4ModelConfig

# ../shared/deepseek-v4.md's tiny configuration, in transformers' spelling
TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    partial_rotary_factor=0.25,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    layer_types=[SLIDING, CSA, HCA, CSA, HCA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8},
    sliding_window=16,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

# DeepSeek's own spelling (V4-Flash's values, 8 layers + the MTP layer's ratio)
LEGACY: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128, 0],
    "num_hash_layers": 3,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
    },
    "expert_dtype": "fp4",
}


def _as_transformers_reads_it(d: dict[str, Any]) -> DeepseekV4Config:
    return DeepseekV4Config.from_dict({k: v for k, v in d.items() if k != "model_type"})


def _matches(ours: V4ModelConfig, hf: DeepseekV4Config) -> None:
    assert list(ours.layer_types) == hf.layer_types
    assert list(ours.mlp_layer_types) == hf.mlp_layer_types
    assert (ours.csa_rate, ours.hca_rate) == (hf.compress_rates[CSA], hf.compress_rates[HCA])
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim
    for name in (
        "vocab_size",
        "hidden_size",
        "head_dim",
        "num_attention_heads",
        "q_lora_rank",
        "sliding_window",
        "o_groups",
        "o_lora_rank",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "n_routed_experts",
        "num_experts_per_tok",
        "scoring_func",
        "routed_scaling_factor",
        "swiglu_limit",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
    ):
        assert getattr(ours, name) == getattr(hf, name), name
    main, compress = hf.rope_parameters["main"], hf.rope_parameters["compress"]
    assert ours.rope_theta == main["rope_theta"] and main["rope_type"] == "default"
    assert ours.compress_rope_theta == compress["rope_theta"]
    rs = ours.compress_rope_scaling
    assert rs is not None and compress["rope_type"] == "yarn"
    assert rs.factor == compress["factor"] and rs.cos_sin_factor == compress["attention_factor"]
    assert rs.cos_sin_factor == 1.0 and rs.softmax_mscale == 1.0  # no YaRN mscale anywhere
    assert rs.original_max_position_embeddings == compress["original_max_position_embeddings"]


def test_transformers_spelling_reads_as_transformers_reads_it() -> None:
    hf = DeepseekV4Config(**TINY)
    ours = V4ModelConfig.from_hf_dict(hf.to_dict())
    _matches(ours, hf)
    assert ours.layer_ids(CSA) == (1, 3) and ours.layer_ids(HCA) == (2, 4)
    assert ours.hash_layer_ids == (0, 1) and ours.block_multiple == 8
    assert [ours.compress_ratio(i) for i in range(5)] == [0, 4, 8, 4, 8]


def test_deepseeks_spelling_reads_as_transformers_reads_it() -> None:
    ours = V4ModelConfig.from_hf_dict(LEGACY)
    _matches(ours, _as_transformers_reads_it(LEGACY))
    assert ours.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA)  # the MTP layer's ratio dropped
    assert ours.hash_layer_ids == (0, 1, 2) and ours.block_multiple == 128
    assert ours.fp8_block_size == (128, 128) and ours.expert_dtype == "fp4"
    # V4-Flash's full-history cache per token and layer kind (values, not bytes): CSA 3 x
    # (512 + 128) / 4, HCA 3 x 512 / 128
    assert ours.kv_values_per_token() == 3 * 640 / 4 + 3 * 512 / 128


@pytest.mark.parametrize("spelling", [TINY, LEGACY], ids=["transformers", "deepseek"])
def test_what_it_writes_reads_back_the_same_in_both(spelling: dict[str, Any]) -> None:
    d = DeepseekV4Config(**TINY).to_dict() if spelling is TINY else spelling
    ours = V4ModelConfig.from_hf_dict(d)
    written = ours.to_hf_dict()
    assert V4ModelConfig.from_hf_dict(written) == ours
    _matches(ours, _as_transformers_reads_it(json.loads(json.dumps(written))))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 2}, "one shared KV head"),
        ({"layer_types": [SLIDING, CSA]}, "layer_types has 2 entries for 5 layers"),
        ({"mlp_layer_types": ["moe"] * 4 + ["dense"]}, "mlp_layer_types: unknown ['dense']"),
        ({"index_head_dim": 8}, "index_head_dim=8 is below the rope dims (16)"),
        ({"o_groups": 3}, "does not split into o_groups=3"),
        ({"scoring_func": "relu"}, "scoring_func 'relu'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    ],
)
def test_a_config_it_cannot_read_says_why(change: dict[str, Any], message: str) -> None:
    d = DeepseekV4Config(**TINY).to_dict() | change
    with pytest.raises(ConfigError, match="^cfg: .*" + re.escape(message)):
        V4ModelConfig.from_hf_dict(d, source="cfg")


def test_a_v4_checkpoint_reads_as_v4(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LEGACY))
    assert read_config(tmp_path) == V4ModelConfig.from_hf_dict(LEGACY)
    with pytest.raises(ConfigError, match="model_type 'deepseek_v4' is not deepseek_v3"):
        ModelConfig.from_hf_dict(LEGACY)
    with pytest.raises(ConfigError, match="compress_ratios: 16 is neither 0"):
        config_from_hf_dict(LEGACY | {"compress_ratios": [0, 16]})
