"""Seeded random models with DeepSeek-V3's structure, for running Ferry without weights.

A preset is a config plus a seed; its weights are generated as a HF-named state dict
(``loader.random_state_dict``) and loaded through the same path as a checkpoint, so a preset and
its ``ferry export-preset`` checkpoint are the same model. Their vocabulary is the byte-level
tokenizer's. No torch here: the CLI lists the presets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.services.common.tokenizer import ByteTokenizer
from ferry.services.engine.model.config import ModelConfig


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
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
}
