"""Random transformers DeepseekV4ForCausalLM checkpoints: the oracle for Ferry's DeepSeek-V4."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)

# A config that crosses every boundary within ~40 tokens: a CSA entry every 4, an HCA entry
# every 8, a 16-token window, top-4 of the CSA entries (pitfalls seen checking it: fewer than 16
# indexer heads make ReLU ties that flip top-k picks; HCA at 128 never fires in a short test).
TINY_V4: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 32,
    "layer_types": [SLIDING, CSA, HCA, CSA, HCA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 8},
    "sliding_window": 16,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 48,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1024,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}


def make_v4_model(seed: int = 0, lm_head_scale: float = 1.0, **overrides: Any) -> Any:
    """A random DeepseekV4ForCausalLM in float32 whose parameters transformers leaves at trivial
    values (sinks, slot biases, mHC bases, the routing bias, tid2eid: all zero) are drawn at
    random; the router wide, so that expert choices have clear margins; attention and the
    compressors at unit gain, so that a wrong mask or rotation shows in the logits.
    ``lm_head_scale`` > 1 widens the logit margins, so that greedy decoding has no near-ties
    that float noise could flip."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = dict(TINY_V4)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    experts = kw["n_routed_experts"]
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((torch.rand(buf.shape, generator=gen) - 0.5) * 0.2)
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=gen)[: buf.shape[1]] for _ in buf]
                buf.copy_(torch.stack(rows))
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]) * 3)
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif ".self_attn." in name and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]) * 1.5)
        model.lm_head.weight.mul_(lm_head_scale)
    return model


def make_v4_checkpoint(
    path: Path, seed: int = 0, lm_head_scale: float = 1.0, **overrides: Any
) -> Path:
    """``make_v4_model`` written by ``save_pretrained`` (the names transformers writes), with the
    byte-level tokenizer of the presets."""
    from ferry.services.common.tokenizer import write_byte_tokenizer_json

    make_v4_model(seed, lm_head_scale, **overrides).save_pretrained(path)
    write_byte_tokenizer_json(path)
    return path


def v4_hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype).eval()


def v4_hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
