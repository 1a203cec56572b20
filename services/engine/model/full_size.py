"""The published models' shapes, without weights: what benchmarks and tests size caches and
transfers by when no full-size checkpoint is at hand."""

from __future__ import annotations

from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v4.config import CSA, HCA, SLIDING, V4ModelConfig

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
