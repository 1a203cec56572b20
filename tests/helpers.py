"""Helpers shared by the tests: random HF checkpoints and FP8 quantization."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.common.tokenizer import ByteTokenizer
from ferry.services.engine.request import Request

TINY_HF: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024,
    "bos_token_id": 256,
    "eos_token_id": 257,
}

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def make_hf_checkpoint(
    path: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    lm_head_scale: float = 1.0,
    **overrides: Any,
) -> Path:
    """Save a random transformers DeepseekV3ForCausalLM. Router weights are drawn wide and the
    correction bias random, so that expert choices have clear margins and the bias matters;
    attention weights are drawn at unit gain so that attention is sharp and a wrong softmax
    scale or rotary embedding shows in the logits. ``lm_head_scale`` > 1 widens the logit
    margins so that greedy decoding has no near-ties that float noise could flip."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(TINY_HF)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((torch.rand(buf.shape, generator=gen) - 0.5) * 0.2)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]) * 3)
            elif ".self_attn." in name and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]) * 1.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        model.lm_head.weight.mul_(lm_head_scale)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


@dataclass(frozen=True)
class Checkpoint:
    """A random tiny checkpoint, by what it is: transformers' DeepSeek-V3 (``family`` "v3",
    ``make_hf_checkpoint``) or V4 ("v4", ``make_v4_checkpoint``), drawn from ``seed``, its
    lm_head scaled by ``lm_head_scale``, with ``config`` over the tiny config. A test module
    names its own as ``CHECKPOINT`` and takes the ``checkpoint`` fixture (tests/conftest.py):
    the path, written once a session."""

    seed: int = 0
    family: str = "v3"
    lm_head_scale: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Equal for equal checkpoints (the config may hold dicts: not hashable)."""
        return json.dumps(asdict(self), sort_keys=True)

    def write(self, path: Path) -> Path:
        if self.family == "v4":
            from tests.helpers_v4 import make_v4_checkpoint

            return make_v4_checkpoint(path, self.seed, self.lm_head_scale, **self.config)
        assert self.family == "v3", self.family
        return make_hf_checkpoint(path, self.seed, lm_head_scale=self.lm_head_scale, **self.config)


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def quantize_fp8_blocks(
    w: torch.Tensor, block: int = 128, e8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style e4m3 weight plus its scale, one per block x block tile: float32
    (V3's weight_scale_inv) or, with ``e8m0``, a power of two stored as E8M0 (V4's .scale)."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = float(tile.abs().max().clamp(min=1e-12)) / 448.0
            s = 2.0 ** math.ceil(math.log2(s)) if e8m0 else s  # rounded up: nothing overflows
            scale[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(
                torch.float8_e4m3fn
            )
    return q, (scale.to(torch.float8_e8m0fnu) if e8m0 else scale)


def quantize_fp4_blocks(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4-style FP4 weight: e2m1 codes two a byte (the even index in the low nibble)
    [rows, cols / 2] uint8, and one E8M0 scale per ``block`` values of a row (a power of two,
    rounded up so that the block's largest value fits 6.0)."""
    rows, cols = w.shape
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    amax = torch.nn.functional.pad(w.abs(), (0, -cols % block)).view(rows, -1, block).amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-12) / 6.0)))
    x = w / scale.repeat_interleave(block, 1)[:, :cols]
    code = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) | ((x < 0).long() << 3)
    pairs = code.view(rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed, scale.to(torch.float8_e8m0fnu)


def rewrite_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate of DeepseekV3ForCausalLM, greedy (see ``greedy_generate``)."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return greedy_generate(model, prompts, max_new_tokens)


def greedy_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate (its own cache path), greedy, one prompt at a time, never
    stopping early."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            # an explicit mask: without one, generate masks every token equal to pad_token_id
            seq = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(seq[0, len(ids) :].tolist())
    return outs


def make_request(rid: str, tokens: list[int], params: SamplingParams | None = None) -> Request:
    """A bare engine Request, for tests of the block pool and the sampler."""
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        params=params or SamplingParams(),
        max_total_tokens=10_000,
        detokenizer=ByteTokenizer().detokenizer(),
    )
