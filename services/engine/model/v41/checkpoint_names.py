"""The tensors of a DeepSeek-V4.1 checkpoint: their shapes as config.json implies them, and
DeepSeek's names for them (the only names V4.1 ships under: no transformers release has it).

Ferry's names are V4's where the part is V4's (``model.layers.L.self_attn.q_a_proj.weight``,
routed experts ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``) and DeepSeek's leaves
for V4.1's own parts: the indexer sits on the attention (``self_attn.indexer.q_b_proj``), its key
projection on the compressor whose entries it reads (``self_attn.compressor.indexer_k_proj``),
Engram on the layer (``model.layers.L.engram.*``), the DSpark stages as ``model.dspark.K.*``
(a block's names, and DeepSeek's for the parts only a stage has: ``main_proj``,
``markov_head.embed``, ``confidence_head.proj`` ...). The vision tower is not loaded yet.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ferry.services.engine.model.v41.config import V41ModelConfig

Shape = tuple[int, ...]

# (DeepSeek's spelling, Ferry's), applied in order to a whole name
_RENAMES: list[tuple[str, str]] = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^layers\.", "model.layers."),
    (r"^mtp\.", "model.dspark."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.wk\.", ".attn.compressor.indexer_k_proj."),
    (r"\.attn\.indexer\.k_norm\.", ".attn.compressor.indexer_k_norm."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.indexer.q_b_proj."),
    (r"\.attn\.compressor\.norm\.", ".attn.compressor.kv_norm."),
    (r"\.attn\.", ".self_attn."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"(?<!engram)\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.ffn\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.ffn\.", ".mlp."),
    (r"\.w1\.weight$", ".gate_proj.weight"),
    (r"\.w3\.weight$", ".up_proj.weight"),
    (r"\.w2\.weight$", ".down_proj.weight"),
]
_TO_FERRY = [(re.compile(p), r) for p, r in _RENAMES]

# Ferry's -> DeepSeek's: each Ferry leaf has one DeepSeek spelling
_TO_DEEPSEEK = [
    (re.compile(p), r)
    for p, r in [
        (r"^model\.embed_tokens\.weight$", "embed.weight"),
        (r"^lm_head\.weight$", "head.weight"),
        (r"^model\.norm\.weight$", "norm.weight"),
        (r"^model\.layers\.", "layers."),
        (r"^model\.dspark\.", "mtp."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
        (r"\.self_attn\.compressor\.indexer_k_proj\.", ".attn.indexer.wk."),
        (r"\.self_attn\.compressor\.indexer_k_norm\.", ".attn.indexer.k_norm."),
        (r"\.self_attn\.compressor\.kv_norm\.", ".attn.compressor.norm."),
        (r"\.self_attn\.compressor\.gate_proj\.", ".attn.compressor.wgate."),
        (r"\.self_attn\.", ".attn."),
        (r"\.sinks$", ".attn_sink"),
        (r"\.q_a_proj\.", ".wq_a."),
        (r"\.q_a_norm\.", ".q_norm."),
        (r"\.q_b_proj\.", ".wq_b."),
        (r"\.kv_proj\.", ".wkv."),
        (r"\.o_a_proj\.", ".wo_a."),
        (r"\.o_b_proj\.", ".wo_b."),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
        (r"\.mlp\.", ".ffn."),
        (r"\.gate_proj\.weight$", ".w1.weight"),
        (r"\.up_proj\.weight$", ".w3.weight"),
        (r"\.down_proj\.weight$", ".w2.weight"),
    ]
]

# not loaded: the vision tower and the image-token router bias (text only), rotary caches
IGNORED_RE = re.compile(r"^(vision|aligner)\.|^image_|\.gate\.bias_vl$|rotary_emb\.")
VISION_RE = re.compile(r"^(vision|aligner)\.|^image_|\.gate\.bias_vl$")
# Engram's table: FP8 rows with one E8M0 scale per 32 values of a row
ENGRAM_TABLE_BLOCK = (1, 32)


def canonical(name: str) -> str:
    for pattern, repl in _TO_FERRY:
        name = pattern.sub(repl, name)
    return name


def stored_name(name: str) -> str:
    for pattern, repl in _TO_DEEPSEEK:
        name = pattern.sub(repl, name)
    return name


def is_ignored(name: str, c: V41ModelConfig) -> bool:
    return IGNORED_RE.search(name) is not None


def is_vision(name: str) -> bool:
    return VISION_RE.search(name) is not None


def ferry_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield canonical(name), tensor


def fp8_block(name: str, c: V41ModelConfig) -> tuple[int, int]:
    """The block of one scale of a stored FP8 tensor."""
    if name.endswith(".engram.embed.weight"):
        return ENGRAM_TABLE_BLOCK
    return c.fp8_block_size or (32, 32)


def checkpoint_shapes(c: V41ModelConfig) -> dict[str, Shape]:
    """Every tensor a text-only checkpoint for ``c`` must hold, by Ferry's name."""
    h = c.hidden_size
    shapes: dict[str, Shape] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.vocab_size, h),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(_block_shapes(c, i, p))
        shapes.update(_moe_shapes(c, p + "mlp.", c.n_routed_experts))
        if i in c.engram_layer_ids:
            shapes.update(_engram_shapes(c, i, p + "engram."))
    stages = c.num_nextn_predict_layers if c.dspark_block_size else 0
    for k in range(stages):
        shapes.update(_dspark_shapes(c, k, f"model.dspark.{k}."))
    return shapes


def _block_shapes(c: V41ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    """A block's norms, mHC and attention."""
    h, hc = c.hidden_size, c.hc_mult
    mixes = (2 + hc) * hc
    s: dict[str, Shape] = {p + "input_layernorm.weight": (h,)}
    s[p + "post_attention_layernorm.weight"] = (h,)
    for part in ("attn_hc", "ffn_hc"):
        s[f"{p}{part}.fn"] = (mixes, hc * h)
        s[f"{p}{part}.base"] = (mixes,)
        s[f"{p}{part}.scale"] = (3,)
    s.update(_attention_shapes(c, layer, p + "self_attn."))
    return s


def _dspark_shapes(c: V41ModelConfig, stage: int, p: str) -> dict[str, Shape]:
    h, rank = c.hidden_size, c.dspark_markov_rank
    s = _block_shapes(c, c.num_hidden_layers + stage, p)
    s.update(_moe_shapes(c, p + "mlp.", c.dspark_n_routed_experts or c.n_routed_experts))
    if stage == 0:
        s[p + "main_proj.weight"] = (h, len(c.dspark_target_layer_ids) * h)
        s[p + "main_norm.weight"] = (h,)
    if stage == c.num_nextn_predict_layers - 1:
        s[p + "norm.weight"] = (h,)
        s[p + "markov_head.embed.weight"] = (c.vocab_size, rank)
        s[p + "markov_head.head.weight"] = (c.vocab_size, rank)
        s[p + "confidence_head.proj.weight"] = (1, h + rank)
    return s


def _attention_shapes(c: V41ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    h, d, heads = c.hidden_size, c.head_dim, c.num_attention_heads
    s: dict[str, Shape] = {
        p + "q_a_proj.weight": (c.q_lora_rank, h),
        p + "q_a_norm.weight": (c.q_lora_rank,),
        p + "q_b_proj.weight": (heads * d, c.q_lora_rank),
        p + "kv_proj.weight": (d, h),
        p + "kv_norm.weight": (d,),
        p + "o_a_proj.weight": (c.o_groups * c.o_lora_rank, heads * d // c.o_groups),
        p + "o_b_proj.weight": (h, c.o_groups * c.o_lora_rank),
        p + "sinks": (heads,),
    }
    if layer in c.kv_source_layer_ids:
        cp = p + "compressor."
        s[cp + "kv_proj.weight"] = (d, h)
        if c.ratio(layer) > 1:
            s[cp + "gate_proj.weight"] = (d, h)
        s[cp + "kv_norm.weight"] = (d,)
        s[cp + "indexer_k_proj.weight"] = (c.index_head_dim, d)
        s[cp + "indexer_k_norm.weight"] = (c.index_head_dim,)
    if layer in c.index_source_layer_ids:
        s[p + "indexer.q_b_proj.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        s[p + "indexer.weights_proj.weight"] = (c.index_n_heads, h)
    return s


def _moe_shapes(c: V41ModelConfig, p: str, experts: int) -> dict[str, Shape]:
    h, inter = c.hidden_size, c.moe_intermediate_size
    s: dict[str, Shape] = {
        p + "gate.weight": (experts, h),
        p + "gate.e_score_correction_bias": (experts,),
    }
    mlp = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    for e in range(experts):
        s.update({f"{p}experts.{e}.{k}.weight": v for k, v in mlp.items()})
    shared = inter * c.n_shared_experts
    s[p + "shared_experts.gate_proj.weight"] = (shared, h)
    s[p + "shared_experts.up_proj.weight"] = (shared, h)
    s[p + "shared_experts.down_proj.weight"] = (h, shared)
    return s


def _engram_shapes(c: V41ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
    cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads
    h, hc = c.hidden_size, c.hc_mult
    return {
        p + "embed.weight": (rows, c.engram_head_dim),
        p + "wkv.weight": (h * (hc + 1), cols * c.engram_head_dim),
        p + "q_weight": (hc, h),
        p + "k_weight": (hc, h),
    }
