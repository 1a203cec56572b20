"""The tensors of a DeepSeek-V3 HF checkpoint, by name and shape, as config.json implies them.
Its names are Ferry's: nothing is renamed or split (``registry.CheckpointNames``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ferry.services.engine.model.v3.config import ModelConfig

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]

LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


def checkpoint_shapes(c: ModelConfig) -> dict[str, Shape]:
    """Every tensor a checkpoint for ``c`` must hold (the MTP layers excepted)."""
    h = c.hidden_size
    shapes: dict[str, Shape] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.vocab_size, h),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(_attention_shapes(c, p + "self_attn."))
        if c.is_moe_layer(i):
            shapes.update(_moe_shapes(c, p + "mlp."))
        else:
            shapes.update(_mlp_shapes(p + "mlp.", h, c.intermediate_size))
    return shapes


def _attention_shapes(c: ModelConfig, p: str) -> dict[str, Shape]:
    h, heads = c.hidden_size, c.num_attention_heads
    s: dict[str, Shape] = {}
    if c.q_lora_rank is None:
        s[p + "q_proj.weight"] = (heads * c.qk_head_dim, h)
    else:
        s[p + "q_a_proj.weight"] = (c.q_lora_rank, h)
        s[p + "q_a_layernorm.weight"] = (c.q_lora_rank,)
        s[p + "q_b_proj.weight"] = (heads * c.qk_head_dim, c.q_lora_rank)
        if c.attention_bias:
            s[p + "q_a_proj.bias"] = (c.q_lora_rank,)
    s[p + "kv_a_proj_with_mqa.weight"] = (c.kv_cache_dim, h)
    s[p + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    s[p + "kv_b_proj.weight"] = (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    s[p + "o_proj.weight"] = (h, heads * c.v_head_dim)
    if c.attention_bias:
        s[p + "kv_a_proj_with_mqa.bias"] = (c.kv_cache_dim,)
        s[p + "o_proj.bias"] = (h,)
    return s


def _mlp_shapes(p: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {
        p + "gate_proj.weight": (inter, hidden),
        p + "up_proj.weight": (inter, hidden),
        p + "down_proj.weight": (hidden, inter),
    }


def _moe_shapes(c: ModelConfig, p: str) -> dict[str, Shape]:
    h, inter = c.hidden_size, c.moe_intermediate_size
    s: dict[str, Shape] = {
        p + "gate.weight": (c.n_routed_experts, h),
        p + "gate.e_score_correction_bias": (c.n_routed_experts,),
    }
    for e in range(c.n_routed_experts):
        s.update(_mlp_shapes(f"{p}experts.{e}.", h, inter))
    if c.n_shared_experts:
        s.update(_mlp_shapes(p + "shared_experts.", h, inter * c.n_shared_experts))
    return s


def is_ignored(name: str, c: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that Ferry does not use: the MTP layers (numbered after the
    last decoder layer) and rotary caches some exporters write."""
    m = LAYER_RE.match(name)
    if m and int(m.group(1)) >= c.num_hidden_layers:
        return True
    return name.endswith("rotary_emb.inv_freq")


def ferry_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield name, tensor


def stored_name(name: str) -> str:
    return name


def fp8_block(name: str, c: ModelConfig) -> tuple[int, int]:
    """Every FP8 tensor's scale covers one block of the config's size (DeepSeek's 128x128)."""
    return c.fp8_block_size or (128, 128)
