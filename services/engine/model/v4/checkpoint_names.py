"""The tensors of a DeepSeek-V4 checkpoint: their shapes as config.json implies them, and the two
naming schemes they come in.

Ferry's names are transformers' module names with the routed experts one tensor per expert
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``, as for V3). A checkpoint may hold:
- DeepSeek's own names (``embed.weight``, ``layers.L.attn.wq_a.weight``,
  ``layers.L.ffn.experts.E.w1.weight``, ``hc_head_fn``; what V4-Flash ships), or
- transformers' names, either as its modules hold them (experts fused into ``gate_up_proj`` /
  ``down_proj``) or as ``save_pretrained`` writes them (a mix: ``model.`` prefixes with
  DeepSeek's leaf names).
``canonical`` maps any of these to Ferry's; ``deepseek_name`` writes DeepSeek's, the name an
exported checkpoint gives a tensor (``stored_name``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ferry.services.engine.model.v4.config import CSA, HCA, V4ModelConfig

Shape = tuple[int, ...]

# (DeepSeek's spelling, Ferry's), applied in order to a name without its "model." prefix;
# each leaves Ferry's own spelling unchanged, so a name may be read twice.
_TO_FERRY: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p), r)
    for p, r in [
        (r"^embed\.weight$", "embed_tokens.weight"),
        (r"^head\.weight$", "lm_head.weight"),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
        (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
        (
            r"\.self_attn\.indexer\.weights_proj\.",
            ".self_attn.compressor.indexer.scorer.weights_proj.",
        ),
        (r"\.attn_sink$", ".sinks"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.norm\.weight$", ".kv_norm.weight"),  # attention and compressor norms
        (r"\.ape$", ".position_bias"),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.w1\.weight$", ".gate_proj.weight"),
        (r"\.w3\.weight$", ".up_proj.weight"),
        (r"\.w2\.weight$", ".down_proj.weight"),
    ]
]

_TO_DEEPSEEK: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p), r)
    for p, r in [
        (r"^embed_tokens\.weight$", "embed.weight"),
        (r"^lm_head\.weight$", "head.weight"),
        (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
        (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
        (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
        (r"\.compressor\.indexer\.", ".indexer.compressor."),
        (r"\.sinks$", ".attn_sink"),
        (r"\.compressor\.kv_norm\.", ".compressor.norm."),
        (r"\.q_a_proj\.", ".wq_a."),
        (r"\.q_a_norm\.", ".q_norm."),
        (r"\.q_b_proj\.", ".wq_b."),
        (r"\.kv_proj\.", ".wkv."),
        (r"\.o_a_proj\.", ".wo_a."),
        (r"\.o_b_proj\.", ".wo_b."),
        (r"\.position_bias$", ".ape"),
        (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
        (r"\.(experts\.\d+|shared_experts)\.gate_proj\.", r".\1.w1."),
        (r"\.(experts\.\d+|shared_experts)\.up_proj\.", r".\1.w3."),
        (r"\.(experts\.\d+|shared_experts)\.down_proj\.", r".\1.w2."),
        (r"\.gate_proj\.", ".wgate."),  # the compressors' (the experts' are done above)
        (r"\.self_attn\.", ".attn."),
        (r"\.mlp\.", ".ffn."),
    ]
]

FUSED_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
IGNORED_RE = re.compile(r"(^|\.)(mtp|dspark)[._]|rotary_emb\.")


def canonical(name: str) -> str:
    """Ferry's name for a checkpoint tensor named in either scheme."""
    bare = name.removeprefix("model.")
    for pattern, repl in _TO_FERRY:
        bare = pattern.sub(repl, bare)
    return bare if bare == "lm_head.weight" else "model." + bare


def deepseek_name(name: str) -> str:
    """DeepSeek's name for one of Ferry's."""
    bare = name.removeprefix("model.")
    for pattern, repl in _TO_DEEPSEEK:
        bare = pattern.sub(repl, bare)
    return bare


def is_ignored(name: str, c: V4ModelConfig) -> bool:
    """Tensors Ferry does not load, whatever the config: the MTP layer (``mtp.*``) and
    drafters, rotary caches."""
    return IGNORED_RE.search(name) is not None


def split_fused_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' fused expert tensors ([E, 2I, H] gate|up, [E, H, I] down) as one tensor
    per expert; any other tensor as it is."""
    m = FUSED_EXPERTS_RE.fullmatch(name)
    if m is None:
        yield name, tensor
        return
    prefix = f"model.layers.{m.group(1)}.mlp.experts."
    for e in range(tensor.shape[0]):
        if m.group(2) == "down_proj":
            yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}{e}.gate_proj.weight", gate
            yield f"{prefix}{e}.up_proj.weight", up


def ferry_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stored tensor by Ferry's name, fused experts split."""
    return split_fused_experts(canonical(name), tensor)


stored_name = deepseek_name  # V4-Flash's names


def checkpoint_shapes(c: V4ModelConfig) -> dict[str, Shape]:
    """Every tensor a checkpoint for ``c`` must hold, by Ferry's name (the MTP layer excepted)."""
    h, hc = c.hidden_size, c.hc_mult
    shapes: dict[str, Shape] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
        "model.hc_head.hc_fn": (hc, hc * h),
        "model.hc_head.hc_base": (hc,),
        "model.hc_head.hc_scale": (1,),
        "lm_head.weight": (c.vocab_size, h),
    }
    mixes = (2 + hc) * hc
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for hcname in ("attn_hc", "ffn_hc"):
            shapes[f"{p}{hcname}.fn"] = (mixes, hc * h)
            shapes[f"{p}{hcname}.base"] = (mixes,)
            shapes[f"{p}{hcname}.scale"] = (3,)
        shapes.update(_attention_shapes(c, i, p + "self_attn."))
        shapes.update(_moe_shapes(c, i, p + "mlp."))
    return shapes


def _attention_shapes(c: V4ModelConfig, layer: int, p: str) -> dict[str, Shape]:
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
    kind = c.layer_types[layer]
    if kind == CSA:
        s.update(_compressor_shapes(p + "compressor.", h, d, c.csa_rate, 2))
        ip = p + "compressor.indexer."
        s.update(_compressor_shapes(ip, h, c.index_head_dim, c.csa_rate, 2))
        s[ip + "q_b_proj.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        s[ip + "scorer.weights_proj.weight"] = (c.index_n_heads, h)
    elif kind == HCA:
        s.update(_compressor_shapes(p + "compressor.", h, d, c.hca_rate, 1))
    return s


def _compressor_shapes(p: str, hidden: int, dim: int, rate: int, series: int) -> dict[str, Shape]:
    return {
        p + "kv_proj.weight": (series * dim, hidden),
        p + "gate_proj.weight": (series * dim, hidden),
        p + "position_bias": (rate, series * dim),
        p + "kv_norm.weight": (dim,),
    }


def _moe_shapes(c: V4ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    h, inter = c.hidden_size, c.moe_intermediate_size
    s: dict[str, Shape] = {p + "gate.weight": (c.n_routed_experts, h)}
    if c.mlp_layer_types[layer] == "hash_moe":
        s[p + "gate.tid2eid"] = (c.vocab_size, c.num_experts_per_tok)
    else:
        s[p + "gate.e_score_correction_bias"] = (c.n_routed_experts,)
    mlp = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    for e in range(c.n_routed_experts):
        s.update({f"{p}experts.{e}.{k}.weight": v for k, v in mlp.items()})
    s.update({f"{p}shared_experts.{k}.weight": v for k, v in mlp.items()})
    return s


def fp8_block(name: str, c: V4ModelConfig) -> tuple[int, int]:
    """Every FP8 tensor's scale covers one block of the config's size (DeepSeek's 128x128)."""
    return c.fp8_block_size or (128, 128)
