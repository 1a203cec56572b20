"""The published models' shapes, without weights: what benchmarks and tests size caches and
transfers by when no full-size checkpoint is at hand."""

from __future__ import annotations

from ferry.services.engine.model.config import RopeScaling
from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v4.config import CSA, HCA, SLIDING, V4ModelConfig
from ferry.services.engine.model.v41.config import V41ModelConfig

# DeepSeek-V3 (and R1, V3.1: the same shapes), as its config.json gives them
DEEPSEEK_V3 = ModelConfig(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    max_position_embeddings=163840,
    source="deepseek-v3",
)

# DeepSeek-V4-Flash, as its config.json gives it
DEEPSEEK_V4_FLASH = V4ModelConfig(
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    layer_types=(SLIDING, SLIDING) + (CSA, HCA) * 20 + (CSA,),
    mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 40,
    csa_rate=4,
    hca_rate=128,
    sliding_window=128,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=256,
    num_experts_per_tok=6,
)

# DeepSeek-V4.1-Flash, as its config.json's text_config gives it (the ViT left out)
DEEPSEEK_V41_FLASH = V41ModelConfig(
    vocab_size=129280,
    hidden_size=5120,
    moe_intermediate_size=2304,
    num_hidden_layers=40,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
    kv_source_layer_ids=(2, 8, 14, 20),
    index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    candidate_source_layer_id=20,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    n_routed_experts=384,
    num_experts_per_tok=6,
    compress_rope_scaling=RopeScaling(16, 65536, 32, 1, attention_factor=1.0),
    engram_layer_ids=(1, 14),
    engram_num_embeddings=(384006168, 384016682),
    engram_max_ngram_size=4,
    engram_vocab_size=16000000,
    engram_n_heads=8,
    engram_head_dim=256,
    engram_compressed_vocab_size=99092,
    num_nextn_predict_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=(37, 38, 39),
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
    dspark_num_experts_per_tok=3,
    image_token_id=129264,
    has_vision=True,
    fp8_block_size=(32, 32),
    expert_dtype="fp4",
    source="deepseek-v4.1-flash",
)
