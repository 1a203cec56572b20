"""ModelConfig: the DeepSeek-V3 hyper-parameters Ferry needs, read from a HF config.json.

Both spellings of a checkpoint's config are accepted: DeepSeek's own (``rope_scaling`` with
``type``, ``rope_theta`` at the top level, ``scoring_func`` / ``topk_method``) and the one that
transformers >= 5 writes (``rope_parameters`` with ``rope_type`` and ``rope_theta`` inside).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ferry.services.engine.model.config import ConfigError, RopeScaling, read_fp8_block


@dataclass(frozen=True)
class ModelConfig:
    model_type: ClassVar[str] = "deepseek_v3"  # config.json's, the family's key in the registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    # FP8 checkpoints: the [rows, cols] block of one weight_scale_inv entry; None when unquantized.
    fp8_block_size: tuple[int, int] | None = None
    # Where the config came from, for error messages.
    source: str = field(default="<config>", compare=False)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{self.source}: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            need(getattr(self, name) > 0, f"{name} must be positive")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
        need(self.n_routed_experts > 0, "n_routed_experts must be positive")
        need(
            0 < self.num_experts_per_tok <= self.n_routed_experts,
            f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts"
            f"={self.n_routed_experts}",
        )
        need(
            self.n_routed_experts % self.n_group == 0,
            f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}",
        )
        need(
            0 < self.topk_group <= self.n_group,
            f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}",
        )
        per_group = self.n_routed_experts // self.n_group
        need(
            self.n_group == 1 or per_group >= 2,
            "group-limited routing needs at least 2 experts per group",
        )
        need(
            self.num_experts_per_tok <= self.topk_group * per_group,
            "num_experts_per_tok exceeds the experts in the top groups",
        )
        need(self.moe_layer_freq >= 1, "moe_layer_freq must be >= 1")

    # ---- derived values -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent cache: c_kv ‖ k_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            scale *= self.rope_scaling.softmax_mscale
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a checkpoint's config.json (DeepSeek's or transformers' spelling)."""
        if d.get("model_type") != cls.model_type:
            raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not deepseek_v3")
        scoring = d.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(
                f"{source}: unsupported scoring_func {scoring!r}; DeepSeek-V3 routing is 'sigmoid'"
            )
        topk_method = d.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise ConfigError(f"{source}: unsupported topk_method {topk_method!r}; need 'noaux_tc'")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: unsupported hidden_act {d.get('hidden_act')!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ConfigError(f"{source}: MLA needs num_key_value_heads == num_attention_heads")
        try:
            rope_theta, rope_scaling = _read_rope(d)
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                moe_intermediate_size=d["moe_intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                q_lora_rank=d.get("q_lora_rank"),
                kv_lora_rank=d["kv_lora_rank"],
                qk_nope_head_dim=d["qk_nope_head_dim"],
                qk_rope_head_dim=d["qk_rope_head_dim"],
                v_head_dim=d["v_head_dim"],
                n_routed_experts=d["n_routed_experts"],
                n_shared_experts=d.get("n_shared_experts") or 0,
                num_experts_per_tok=d["num_experts_per_tok"],
                n_group=d.get("n_group") or 1,
                topk_group=d.get("topk_group") or 1,
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                first_k_dense_replace=d.get("first_k_dense_replace") or 0,
                moe_layer_freq=d.get("moe_layer_freq") or 1,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                rope_interleave=bool(d.get("rope_interleave", True)),
                max_position_embeddings=d.get("max_position_embeddings", 4096),
                attention_bias=bool(d.get("attention_bias", False)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                num_nextn_predict_layers=d.get("num_nextn_predict_layers") or 0,
                fp8_block_size=read_fp8_block(d, source),
                source=source,
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as transformers >= 5 writes it, plus DeepSeek's routing fields."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            rope = {
                "rope_type": "yarn",
                "rope_theta": self.rope_theta,
                "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow,
                "mscale": rs.mscale,
                "mscale_all_dim": rs.mscale_all_dim,
            }
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            "num_nextn_predict_layers": 0,
            "torch_dtype": "float32",
        }


def _read_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ConfigError(f"unsupported rope type {kind!r}; Ferry supports default and yarn")
    max_pos = d.get("max_position_embeddings", 4096)
    orig = int(params.get("original_max_position_embeddings", max_pos))
    factor = params.get("factor") or max_pos / orig
    return theta, RopeScaling(
        factor=float(factor),
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
