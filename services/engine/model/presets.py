"""Seeded random models with DeepSeek-V3's, -V4's or -V4.1's structure, for running Ferry without
weights.

A preset is a config plus a seed; its weights are generated as a Ferry-named state dict
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
from ferry.services.engine.model.v41.config import V41ModelConfig


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


# The byte tokenizer's 384 ids normalise to this many Engram ids (engram.compressed_token_map of
# the tokenizer.json that tokenizer.write_byte_tokenizer_json writes)
BYTE_ENGRAM_VOCAB = 355
DSPARK_NOISE_ID = 259  # the first reserved id of the byte tokenizer

# The V4.1 presets' layer schedule: the golden mini-flash roles in 8 layers.
#   L0, L1  SWA only (L1 Engram)        L4  ratio-1 kv + index + candidate source
#   L2      ratio-2 kv + index source    L5  ratio-1 consumer
#           (Engram)                     L6  ratio-1 index source, two-level top-k
#   L3      ratio-2 consumer             L7  ratio-1 consumer
# then 3 DSpark stages (ratio 0) tapping L5-L7.
V41_SCHEDULE: dict[str, object] = {
    "num_hidden_layers": 8,
    "compress_ratios": (0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0),
    "kv_source_layer_ids": (2, 4),
    "index_source_layer_ids": (2, 4, 6),
    "candidate_source_layer_id": 4,
    "engram_layer_ids": (1, 2),
    "num_nextn_predict_layers": 3,
    "dspark_target_layer_ids": (5, 6, 7),
}


def _v41_preset_config(**kw: object) -> V41ModelConfig:
    base: dict[str, object] = {
        "vocab_size": ByteTokenizer.VOCAB_SIZE,
        "bos_token_id": ByteTokenizer.BOS_ID,
        "eos_token_ids": (ByteTokenizer.EOS_ID,),
        "max_position_embeddings": 4096,
        "compress_rope_scaling": RopeScaling(
            factor=16.0, original_max_position_embeddings=256, attention_factor=1.0
        ),
        "engram_max_ngram_size": 4,
        "engram_pad_token_id": ByteTokenizer.PAD_ID,
        "engram_compressed_vocab_size": BYTE_ENGRAM_VOCAB,
        "dspark_block_size": 5,
        "dspark_noise_token_id": DSPARK_NOISE_ID,
        "dspark_num_experts_per_tok": 2,
        "fp8_block_size": (32, 32),  # quantized as the released checkpoint
        "expert_dtype": "fp4",
        "source": "preset",
        **V41_SCHEDULE,
    }
    base.update(kw)
    config = V41ModelConfig(**base)  # type: ignore[arg-type]
    config.validate()
    return config


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
    # ≈9.1M parameters: v4-tiny's width, experts and routed-expert FLOPs (8 layers x top-4 of
    # width 64 = v4-tiny's 4 x top-4 of 128); window and top-k small enough that a 40-token
    # prompt drops index entries at both ratios and candidate blocks restrict L6
    "v41-tiny": Preset(
        _v41_preset_config(
            hidden_size=256,
            moe_intermediate_size=64,
            num_attention_heads=4,
            head_dim=64,
            qk_rope_head_dim=16,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=64,
            sliding_window=16,
            index_n_heads=8,
            index_head_dim=32,
            index_topk=8,
            candidate_topk_blocks=4,  # (4 - 1) x 4 >= index_topk
            candidate_block_size=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            engram_vocab_size=1000,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_num_embeddings=(6126, 6332),  # the sums of each layer's 6 bucket primes
            dspark_markov_rank=32,
            dspark_n_routed_experts=8,
        ),
        seed=4,
    ),
    # ≈69M parameters: v4-small's width, heads, window, experts and routed-expert FLOPs
    # (8 layers x top-4 of width 144 = v4-small's 6 x top-4 of 192), for benches against it
    "v41-small": Preset(
        _v41_preset_config(
            hidden_size=512,
            moe_intermediate_size=144,
            num_attention_heads=8,
            head_dim=128,
            qk_rope_head_dim=32,
            q_lora_rank=128,
            o_groups=4,
            o_lora_rank=128,
            sliding_window=64,
            index_n_heads=16,
            index_head_dim=64,
            index_topk=16,
            candidate_topk_blocks=4,  # (4 - 1) x 8 >= index_topk
            candidate_block_size=8,
            n_routed_experts=32,
            num_experts_per_tok=4,
            engram_vocab_size=2000,
            engram_n_heads=4,
            engram_head_dim=32,
            engram_num_embeddings=(24562, 25586),  # the sums of each layer's 12 bucket primes
            dspark_markov_rank=64,
            dspark_n_routed_experts=16,
        ),
        seed=5,
    ),
}
