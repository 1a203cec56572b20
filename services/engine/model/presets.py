"""Seeded random models with DeepSeek-V3's or DeepSeek-V4's structure, for running Ferry without
weights.

A preset is a config plus a seed; its weights are generated as a HF-named state dict
(``loader.random_state_dict``) and loaded through the same path as a checkpoint, so a preset and
its ``ferry export-preset`` checkpoint are the same model. Their vocabulary is the byte-level
tokenizer's. No torch here: the CLI lists the presets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.services.common.tokenizer import ByteTokenizer
from ferry.services.engine.model.config import RopeScaling
from ferry.services.engine.model.registry import AnyModelConfig
from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v4.config import CSA, HCA, SLIDING, V4ModelConfig


@dataclass(frozen=True)
class Preset:
    config: AnyModelConfig
    seed: int
    init_std: float = 0.02


def _preset_config(**kw: object) -> ModelConfig:
    base: dict[str, object] = {
        "vocab_size": ByteTokenizer.VOCAB_SIZE,
        "bos_token_id": ByteTokenizer.BOS_ID,
        "eos_token_ids": (ByteTokenizer.EOS_ID,),
        "rope_interleave": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096,
        "source": "preset",
    }
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _v4_preset_config(**kw: object) -> V4ModelConfig:
    base: dict[str, object] = {
        "vocab_size": ByteTokenizer.VOCAB_SIZE,
        "bos_token_id": ByteTokenizer.BOS_ID,
        "eos_token_ids": (ByteTokenizer.EOS_ID,),
        "max_position_embeddings": 4096,
        "compress_rope_scaling": RopeScaling(
            factor=16.0,
            original_max_position_embeddings=256,
            mscale=0.0,
            attention_factor=1.0,
        ),
        "source": "preset",
    }
    base.update(kw)
    return V4ModelConfig(**base)  # type: ignore[arg-type]


PRESETS: dict[str, Preset] = {
    # ≈6.4M parameters
    "tiny": Preset(
        _preset_config(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=8,
            q_lora_rank=128,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
        seed=0,
    ),
    # ≈59M parameters
    "small": Preset(
        _preset_config(
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=192,
            num_hidden_layers=6,
            num_attention_heads=16,
            q_lora_rank=256,
            kv_lora_rank=128,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=32,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
        seed=1,
    ),
    # ≈7.8M parameters: one layer of each attention kind (and a second CSA), hash and learned
    # MoE; windows and rates small enough that short prompts cross every boundary
    "v4-tiny": Preset(
        _v4_preset_config(
            hidden_size=256,
            moe_intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=64,
            qk_rope_head_dim=16,
            q_lora_rank=64,
            layer_types=(SLIDING, CSA, HCA, CSA),
            mlp_layer_types=("hash_moe", "hash_moe", "moe", "moe"),
            csa_rate=4,
            hca_rate=16,
            sliding_window=32,
            o_groups=2,
            o_lora_rank=64,
            index_n_heads=16,
            index_head_dim=32,
            index_topk=8,
            n_routed_experts=16,
            num_experts_per_tok=4,
        ),
        seed=2,
    ),
    # ≈65M parameters
    "v4-small": Preset(
        _v4_preset_config(
            hidden_size=512,
            moe_intermediate_size=192,
            num_hidden_layers=6,
            num_attention_heads=8,
            head_dim=128,
            qk_rope_head_dim=32,
            q_lora_rank=128,
            layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA),
            mlp_layer_types=("hash_moe", "hash_moe", "moe", "moe", "moe", "moe"),
            csa_rate=4,
            hca_rate=32,
            sliding_window=64,
            o_groups=4,
            o_lora_rank=128,
            index_n_heads=16,
            index_head_dim=64,
            index_topk=16,
            n_routed_experts=32,
            num_experts_per_tok=4,
        ),
        seed=3,
    ),
}
