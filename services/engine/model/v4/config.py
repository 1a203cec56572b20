"""V4ModelConfig: the DeepSeek-V4 hyper-parameters (V4-Flash, -Base), read from a config.json.

Both spellings are read the way transformers' ``DeepseekV4Config`` reads them (it is the parity
oracle): its own (``layer_types``, ``mlp_layer_types``, ``compress_rates``, ``rope_parameters``
keyed ``main`` / ``compress``, ``partial_rotary_factor``) and DeepSeek's (``compress_ratios`` per
layer, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` for the compressed layers).
Every ratio, window, head count and top-k comes from the config; nothing assumes V4-Flash's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ferry.services.engine.model.config import ConfigError, RopeScaling, read_fp8_block

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # an entry every csa_rate tokens, chosen by the indexer
HCA = "heavily_compressed_attention"  # an entry every hca_rate tokens, all attended
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")  # hash_moe: experts by token id (tid2eid), no learned router
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
DEFAULT_HASH_LAYERS = 3
DEFAULT_ROPE_FRACTION = 64 / 512  # V4-Flash's qk_rope_head_dim / head_dim
LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}  # DeepSeek's compress_ratios, as transformers


class _FieldError(ValueError):
    """A field of config.json that cannot be read (from_hf_dict names the file)."""


@dataclass(frozen=True)
class V4ModelConfig:
    model_type: ClassVar[str] = "deepseek_v4"  # config.json's, the family's key in the registry
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # K = V: one shared-KV head of this size (MQA)
    qk_rope_head_dim: int  # the trailing dims of each head that RoPE rotates (interleaved)
    q_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    sliding_window: int
    o_groups: int  # the grouped output projection: heads split into this many groups
    o_lora_rank: int  # each group's width after o_a_proj
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str = "sqrtsoftplus"
    # transformers builds one shared expert whatever n_shared_experts says, and renormalises the
    # routing weights whatever norm_topk_prob says: both are kept only to write them back
    n_shared_experts: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0  # routed and shared experts: gate <= limit, |up| <= limit
    hc_mult: int = 4  # mHC: residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # sliding-only layers ("main"): plain RoPE
    compress_rope_theta: float = 160000.0  # CSA/HCA layers ("compress")
    # YaRN of the compressed layers; its attention_factor is 1.0 (no mscale on cos/sin or softmax)
    compress_rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint (mtp.*: not loaded)
    # FP8 dense weights: the [rows, cols] block of one scale; None when unquantized
    fp8_block_size: tuple[int, int] | None = None
    expert_dtype: str = ""  # "fp4" (V4-Flash) or "fp8" (V4-Flash-Base); "": as the dense ones
    source: str = field(default="<config>", compare=False)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{self.source}: {msg}")

        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            need(getattr(self, name) > 0, f"{name} must be positive")
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES),
        ):
            need(len(types) == n, f"{name} has {len(types)} entries for {n} layers")
            bad = sorted(set(types) - set(allowed))
            need(not bad, f"{name}: unknown {bad}; one of {', '.join(allowed)}")
        need(self.csa_rate > 0 and self.hca_rate > 0, "compress rates must be positive")
        need(self.sliding_window > 0, "sliding_window must be positive")
        need(self.qk_rope_head_dim % 2 == 0, "the rope dims (qk_rope_head_dim) must be even")
        need(0 < self.qk_rope_head_dim <= self.head_dim, "qk_rope_head_dim must be in 1..head_dim")
        need(
            self.index_head_dim >= self.qk_rope_head_dim,
            f"index_head_dim={self.index_head_dim} is below the rope dims "
            f"({self.qk_rope_head_dim}): the indexer rotates as many",
        )
        need(
            self.num_attention_heads * self.head_dim % self.o_groups == 0,
            f"heads x head_dim ({self.num_attention_heads} x {self.head_dim}) does not split "
            f"into o_groups={self.o_groups}",
        )
        need(self.index_topk > 0 and self.index_n_heads > 0, "the indexer needs heads and top-k")
        need(
            0 < self.num_experts_per_tok <= self.n_routed_experts,
            f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts"
            f"={self.n_routed_experts}",
        )
        need(self.scoring_func in SCORING, f"scoring_func {self.scoring_func!r}: one of {SCORING}")
        need(self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "mHC needs hc_mult, iterations")
        need(self.expert_dtype in ("", "fp4", "fp8"), f"expert_dtype {self.expert_dtype!r}")

    # ---- derived values -------------------------------------------------------------------
    def compress_ratio(self, layer_id: int) -> int:
        """Tokens per compressed entry of ``layer_id`` (0: sliding window only)."""
        kind = self.layer_types[layer_id]
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    def layer_ids(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def n_group(self) -> int:
        """Expert groups of group-limited routing: V4 routes over all experts at once."""
        return 1

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Every V4 layer is MoE (hash-routed or learned): no dense layers."""
        return tuple(range(self.num_hidden_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return 0 <= layer_id < self.num_hidden_layers

    @property
    def hash_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "hash_moe")

    @property
    def block_multiple(self) -> int:
        """A paged KV block holds whole compressed entries of every layer: its size is a
        multiple of this (the least common multiple of the rates the layers use)."""
        rates = {self.compress_ratio(i) for i in range(self.num_hidden_layers)} - {0}
        return math.lcm(*rates) if rates else 1

    def kv_values_per_token(self) -> float:
        """Values per token the full-history cache holds, over every layer: CSA entries and
        their indexer keys, HCA entries (the sliding window and the compressor state are a
        fixed part per request)."""
        csa = len(self.layer_ids(CSA)) * (self.head_dim + self.index_head_dim) / self.csa_rate
        return csa + len(self.layer_ids(HCA)) * self.head_dim / self.hca_rate

    def replace(self, **changes: Any) -> V4ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- config.json ----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> V4ModelConfig:
        """Build from a config.json in transformers' or DeepSeek's spelling."""
        if d.get("model_type") != cls.model_type:
            raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not deepseek_v4")
        if (d.get("num_key_value_heads") or 1) != 1:
            raise ConfigError(f"{source}: DeepSeek-V4 attention has one shared KV head")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: unsupported hidden_act {d.get('hidden_act')!r}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"{source}: DeepSeek-V4 has no attention or MLP biases")
        try:
            return cls._from_dict(d, source)
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None
        except _FieldError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any], source: str) -> V4ModelConfig:
        n = d["num_hidden_layers"]
        csa_rate, hca_rate = _read_rates(d)
        head_dim = d.get("head_dim", 512)
        fraction = d.get("partial_rotary_factor") or (
            d["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in d else None
        )
        eos = d.get("eos_token_id", 1)
        quant = d.get("quantization_config") or {}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            moe_intermediate_size=d["moe_intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=d["num_attention_heads"],
            head_dim=head_dim,
            qk_rope_head_dim=int(head_dim * (fraction or DEFAULT_ROPE_FRACTION)),
            q_lora_rank=d["q_lora_rank"],
            layer_types=_read_layer_types(d, n, csa_rate, hca_rate),
            mlp_layer_types=_read_mlp_types(d, n),
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            sliding_window=d.get("sliding_window", 128),
            o_groups=d["o_groups"],
            o_lora_rank=d["o_lora_rank"],
            index_n_heads=d["index_n_heads"],
            index_head_dim=d["index_head_dim"],
            index_topk=d["index_topk"],
            n_routed_experts=d["n_routed_experts"],
            num_experts_per_tok=d["num_experts_per_tok"],
            scoring_func=d.get("scoring_func", "sqrtsoftplus"),
            n_shared_experts=d.get("n_shared_experts", 1),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            hc_mult=d.get("hc_mult", 4),
            hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            **_read_ropes(d),
            max_position_embeddings=d.get("max_position_embeddings", 1 << 20),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers") or 0,
            fp8_block_size=read_fp8_block(d, source),
            expert_dtype=quant.get("expert_dtype") or d.get("expert_dtype") or "",
            source=source,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as transformers' DeepseekV4Config writes it (what its from_dict reads)."""
        compress: dict[str, Any] = {"rope_type": "default"}
        if (rs := self.compress_rope_scaling) is not None:
            compress = {
                "rope_type": "yarn",
                "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow,
                "attention_factor": rs.cos_sin_factor,
            }
        fraction = self.qk_rope_head_dim / self.head_dim
        eos = self.eos_token_ids
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": fraction,
            "q_lora_rank": self.q_lora_rank,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rates": {CSA: self.csa_rate, HCA: self.hca_rate},
            "sliding_window": self.sliding_window,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "scoring_func": self.scoring_func,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": fraction,
                },
                "compress": {
                    **compress,
                    "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": fraction,
                },
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if len(eos) != 1 else eos[0],
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "torch_dtype": "float32",
            **self._quantization(),
        }

    def _quantization(self) -> dict[str, Any]:
        experts = {"expert_dtype": self.expert_dtype} if self.expert_dtype else {}
        if self.fp8_block_size is None:
            return experts
        block = list(self.fp8_block_size)
        return {
            "quantization_config": {"quant_method": "fp8", "weight_block_size": block, **experts}
        }


def _read_rates(d: dict[str, Any]) -> tuple[int, int]:
    rates = d.get("compress_rates") or {}
    csa = d.get("compress_rate_csa") or rates.get(CSA, 4)
    hca = d.get("compress_rate_hca") or rates.get(HCA, 128)
    return int(csa), int(hca)


def _read_layer_types(d: dict[str, Any], n: int, csa: int, hca: int) -> tuple[str, ...]:
    """Explicit ``layer_types``; else DeepSeek's per-layer ``compress_ratios`` (one more entry
    than layers: the MTP layer's, dropped); else transformers' default schedule."""
    if d.get("layer_types") is not None:
        return tuple(d["layer_types"][:n])
    if d.get("compress_ratios") is not None:
        by_rate = {**LEGACY_RATIOS, csa: CSA, hca: HCA, 0: SLIDING}
        try:
            return tuple(by_rate[r] for r in d["compress_ratios"][:n])
        except KeyError as e:
            raise _FieldError(
                f"compress_ratios: {e.args[0]} is neither 0, the CSA rate {csa} nor the HCA "
                f"rate {hca}"
            ) from None
    interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return (HCA,) * min(n, 2) + tuple(interleave)


def _read_mlp_types(d: dict[str, Any], n: int) -> tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        return tuple(d["mlp_layer_types"][:n])
    hashed = d.get("num_hash_layers")
    hashed = DEFAULT_HASH_LAYERS if hashed is None else hashed
    return ("hash_moe",) * min(n, hashed) + ("moe",) * max(0, n - hashed)


def _read_ropes(d: dict[str, Any]) -> dict[str, Any]:
    """The two RoPE tables: "main" (sliding-only layers, no scaling) and "compress" (CSA/HCA:
    their own theta and YaRN without mscale). transformers' nested ``rope_parameters``, or a
    flat ``rope_parameters`` / DeepSeek's ``rope_scaling`` that is the compress one's YaRN."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    main_theta = float(d.get("rope_theta", 10000.0))
    compress_theta = float(d.get("compress_rope_theta", 160000.0))
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise _FieldError("rope_parameters.main: DeepSeek-V4's sliding layers have no scaling")
        main_theta = float(main.get("rope_theta", main_theta))
        compress_theta = float(compress.get("rope_theta", compress_theta))
    else:
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
    kind = compress.get("rope_type", compress.get("type", "default"))
    scaling = None
    if kind == "yarn":
        orig = int(compress["original_max_position_embeddings"])
        scaling = RopeScaling(
            factor=float(compress["factor"]),
            original_max_position_embeddings=orig,
            beta_fast=float(compress.get("beta_fast") or 32),
            beta_slow=float(compress.get("beta_slow") or 1),
            mscale=0.0,
            mscale_all_dim=0.0,
            attention_factor=float(compress.get("attention_factor") or 1.0),
            truncate=bool(compress.get("truncate", True)),
        )
    elif kind != "default":
        raise _FieldError(f"unsupported rope type {kind!r} for the compressed layers")
    return {
        "rope_theta": main_theta,
        "compress_rope_theta": compress_theta,
        "compress_rope_scaling": scaling,
    }
