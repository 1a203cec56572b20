"""V41ModelConfig: the DeepSeek-V4.1 hyper-parameters, read from a config.json in either of the
two forms it ships in:
- Hugging Face's (``model_type: deepseek_v41``, the text fields under ``text_config``, the ViT
  under ``vision_config``), and
- the flat ``inference/config.json`` of DeepSeek's reference code (``dim``, ``n_layers``,
  ``kv_source_layers`` ...; no ``model_type``).

The roles of every layer follow from four lists (see ``layer_roles``): ``compress_ratios`` (one
per layer, the DSpark stages last), ``kv_source_layer_ids`` (the layers that own a compressor, the
compressed cache and the index keys), ``index_source_layer_ids`` (the layers that run an indexer)
and ``candidate_source_layer_id`` (the two-level top-k's first level). No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ferry.services.engine.model.config import ConfigError, RopeScaling, read_fp8_block

RATIOS = (0, 1, 2)  # 0: window only; 1: one compressed entry per token; 2: one per 2 tokens
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")

# the reference's flat names -> Hugging Face's text_config names (the rest are spelled alike)
FLAT_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}


@dataclass(frozen=True)
class V41ModelConfig:
    model_type: ClassVar[str] = "deepseek_v41"
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # K = V, one shared head (MQA), layout [nope | rope]
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per layer, then one per DSpark stage
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    candidate_source_layer_id: int = -1  # -1: one-level top-k everywhere
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0  # the router's logits are divided by it
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20  # every RMSNorm and the mHC mix normalisation
    rope_theta: float = 10000.0  # ratio-0 layers and DSpark: plain RoPE
    compress_rope_theta: float = 160000.0  # ratio > 0 layers: this theta with YaRN
    compress_rope_scaling: RopeScaling | None = None  # YaRN, frequencies only (no mscale)
    max_position_embeddings: int = 1 << 20
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0  # DSpark stages (mtp.*)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    image_token_id: int | None = None
    has_vision: bool = False  # a vision_config is present (the ViT is not served yet)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None  # None: an unquantized checkpoint
    expert_dtype: str = ""  # "fp4": routed experts FP4 e2m1 with E8M0 scales per 32
    source: str = field(default="<config>", compare=False)

    # ---- what the rest of Ferry asks of a config --------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers  # every layer is MoE (no dense, no hash layers)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_hidden_layers))

    @property
    def n_group(self) -> int:
        return 1

    @property
    def topk_group(self) -> int:
        return 1

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    # ---- layer roles ------------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose compressed cache ``layer`` reads: the nearest kv source at or below
        it (None for a ratio-0 layer)."""
        if self.ratio(layer) == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source_of(self, layer: int) -> int | None:
        """The layer whose top-k ``layer`` attends with: itself if it runs an indexer, else the
        nearest index source below it (None for a ratio-0 layer)."""
        if self.ratio(layer) == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """An index source above the candidate source: its top-k is taken inside the
        candidate blocks (level two)."""
        c = self.candidate_source_layer_id
        return layer in self.index_source_layer_ids and 0 <= c < layer

    def layer_roles(self) -> list[str]:
        """One line per layer, as the golden cases' ``case.json`` lists them."""
        out = []
        for i in range(self.num_hidden_layers):
            r = self.ratio(i)
            parts = ["SWA only" if r == 0 else f"ratio {r}"]
            if i in self.kv_source_layer_ids:
                parts.append("kv source")
            if i in self.index_source_layer_ids:
                parts.append("index source")
            if i == self.candidate_source_layer_id:
                parts.append("candidate source")
            elif self.uses_candidates(i):
                parts.append("two-level top-k")
            if r and i not in self.kv_source_layer_ids + self.index_source_layer_ids:
                parts.append("consumer")
            if i in self.dspark_target_layer_ids:
                parts.append("DSpark tap")
            if i in self.engram_layer_ids:
                parts.append("Engram")
            out.append(f"L{i}: " + ", ".join(parts))
        return out

    # ---- reading ----------------------------------------------------------------------------
    @staticmethod
    def is_reference_form(d: dict[str, Any]) -> bool:
        """DeepSeek's flat inference/config.json (it has no model_type)."""
        return "model_type" not in d and "kv_source_layers" in d and "n_layers" in d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> V41ModelConfig:
        try:
            if cls.is_reference_form(d):
                text, top = {FLAT_NAMES.get(k, k): v for k, v in d.items()}, d
                text["rope_scaling"] = _flat_rope_scaling(d)
                quantized = d.get("dtype") == "fp8"
                fp8_block = (32, 32) if quantized else None
                expert_dtype = d.get("expert_dtype") or ""
                has_vision = bool(d.get("vision_n_layers"))
            else:
                text = d.get("text_config", d)
                top = d
                fp8_block = read_fp8_block(d, source) or read_fp8_block(text, source)
                q = d.get("quantization_config") or {}
                expert_dtype = q.get("expert_dtype") or ""
                has_vision = bool(d.get("vision_config"))
            config = cls._from_text(text, top, fp8_block, expert_dtype, has_vision, source)
        except _FieldError as e:
            raise ConfigError(f"{source}: {e}") from None
        config.validate()
        return config

    @classmethod
    def _from_text(
        cls,
        t: dict[str, Any],
        top: dict[str, Any],
        fp8_block: tuple[int, int] | None,
        expert_dtype: str,
        has_vision: bool,
        source: str,
    ) -> V41ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        simple = {k: v for k, v in t.items() if k in names and k not in _SPECIAL and v is not None}
        for k in _TUPLES:
            if k in simple:
                simple[k] = tuple(int(x) for x in _list(t, k))
        for k in _REQUIRED:
            if k not in simple:
                raise _FieldError(f"text_config.{k} is missing")
        eos = t.get("eos_token_id", top.get("eos_token_id"))
        image = top.get("image_token_id", t.get("image_token_id"))
        return cls(
            **simple,
            compress_rope_scaling=_rope_scaling(t.get("rope_scaling")),
            image_token_id=None if image is None else int(image),
            has_vision=has_vision,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            fp8_block_size=fp8_block,
            expert_dtype=expert_dtype,
            source=source,
        )

    # ---- writing ----------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in Hugging Face's form, which ``from_hf_dict`` reads back to an equal
        config. Text only: ``has_vision`` records a vision_config Ferry does not read, so none
        is written."""
        text: dict[str, Any] = {
            "model_type": f"{self.model_type}_text",
            "num_key_value_heads": 1,
            "topk_method": "noaux_tc",
        }
        for f in dataclasses.fields(self):
            if f.name not in _NOT_TEXT:
                value = getattr(self, f.name)
                text[f.name] = list(value) if isinstance(value, tuple) else value
        if self.gate_temp != 1.0:  # not a config.json field: the reference's default is 1.0
            text["gate_temp"] = self.gate_temp
        eos = self.eos_token_ids
        text["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) or None)
        if (rs := self.compress_rope_scaling) is not None:
            text["rope_scaling"] = {
                "type": "yarn",
                "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow,
            }
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": self.model_type,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }
        if self.image_token_id is not None:
            out["image_token_id"] = self.image_token_id
        if self.fp8_block_size is not None:
            out["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.fp8_block_size),
                "scale_fmt": "ue8m0",
                **({"expert_dtype": self.expert_dtype} if self.expert_dtype else {}),
            }
        return out

    def validate(self) -> None:
        """Raise ConfigError naming the file and the field for a config that cannot run."""
        for message in self._problems():
            raise ConfigError(f"{self.source}: {message}")

    def _problems(self) -> list[str]:
        n, ratios = self.num_hidden_layers, self.compress_ratios
        out = []
        stages = self.num_nextn_predict_layers
        if len(ratios) != n + stages:
            out.append(
                f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers + "
                f"num_nextn_predict_layers = {n} + {stages}"
            )
            return out
        if bad := [r for r in ratios if r not in RATIOS]:
            out.append(f"compress_ratios holds {bad[0]}; V4.1 layers have ratio 0, 1 or 2")
        if any(ratios[n:]):
            out.append("compress_ratios: the DSpark stages (the last entries) must be 0")
        if self.scoring_func not in SCORING:
            out.append(f"scoring_func {self.scoring_func!r}: one of {', '.join(SCORING)}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                out.append(f"{name} {list(ids)}: distinct, ascending layer ids below {n}")
            if zero := [i for i in ids if 0 <= i < n and ratios[i] == 0]:
                out.append(f"{name}: layer {zero[0]} has compress ratio 0")
        out += self._source_problems()
        out += self._candidate_problems()
        if self.head_dim <= self.qk_rope_head_dim or self.qk_rope_head_dim % 2:
            out.append("qk_rope_head_dim must be even and below head_dim")
        if self.index_head_dim < self.qk_rope_head_dim:
            out.append("index_head_dim must be at least qk_rope_head_dim")
        if self.num_attention_heads % self.o_groups:
            out.append(f"num_attention_heads is not a multiple of o_groups {self.o_groups}")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            out.append("engram_num_embeddings needs one entry per engram_layer_ids entry")
        if any(not 0 <= i < n for i in self.engram_layer_ids):
            out.append(f"engram_layer_ids {list(self.engram_layer_ids)}: layer ids below {n}")
        if bad_tap := [i for i in self.dspark_target_layer_ids if not 0 <= i < n]:
            out.append(f"dspark_target_layer_ids: {bad_tap[0]} is not a layer")
        return out

    def _source_problems(self) -> list[str]:
        out = []
        for i in range(self.num_hidden_layers):
            r = self.ratio(i)
            if r == 0:
                continue
            kv = [s for s in self.kv_source_layer_ids if s <= i]
            if not kv:
                out.append(f"layer {i} has ratio {r} but no kv_source_layer_ids entry at or below")
                continue
            if self.ratio(kv[-1]) != r:
                out.append(
                    f"layer {i} (ratio {r}) would read kv source {kv[-1]}, whose ratio is "
                    f"{self.ratio(kv[-1])}: compress_ratios and kv_source_layer_ids disagree"
                )
            idx = [s for s in self.index_source_layer_ids if s <= i]
            if not idx:
                out.append(
                    f"layer {i} has ratio {r} but no index_source_layer_ids entry at or below"
                )
            elif self.ratio(idx[-1]) != r:
                out.append(
                    f"layer {i} (ratio {r}) would reuse the top-k of index source {idx[-1]} "
                    f"(ratio {self.ratio(idx[-1])})"
                )
        return out

    def _candidate_problems(self) -> list[str]:
        c = self.candidate_source_layer_id
        if c < 0:
            return []
        out = []
        if c not in self.index_source_layer_ids:
            return [f"candidate_source_layer_id {c} is not an index source"]
        if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
            out.append("candidate_topk_blocks and candidate_block_size must be positive")
        budget = (self.candidate_topk_blocks - 1) * self.candidate_block_size
        if budget < self.index_topk:
            out.append(
                f"(candidate_topk_blocks - 1) x candidate_block_size = {budget} is below "
                f"index_topk {self.index_topk}: the partly filled newest block may leave fewer "
                "candidates than the top-k takes"
            )
        for i in self.index_source_layer_ids:
            if i > c and self.ratio(i) != self.ratio(c):
                out.append(f"index source {i} takes candidates from layer {c} of another ratio")
        return out

    def block_alignment(self) -> int:
        """A cache block must hold whole compressed entries: any multiple of the ratios' LCM."""
        return 2 if 2 in self.compress_ratios else 1


_SPECIAL = {
    "rope_scaling",
    "eos_token_id",
    "image_token_id",
    "source",
    "compress_rope_scaling",
    "expert_dtype",
    "fp8_block_size",
    "has_vision",
}
# fields to_hf_dict writes elsewhere than under their own name in text_config
_NOT_TEXT = _SPECIAL | {"eos_token_ids", "gate_temp"}
_TUPLES = (
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "engram_layer_ids",
    "engram_num_embeddings",
    "dspark_target_layer_ids",
)
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
)


class _FieldError(ValueError):
    """A field that cannot be read (from_hf_dict names the file)."""


def _list(d: dict[str, Any], key: str) -> list[Any]:
    v = d[key]
    if not isinstance(v, list | tuple):
        raise _FieldError(f"{key} must be a list, got {v!r}")
    return list(v)


def _rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise _FieldError(f"rope_scaling type {kind!r}: V4.1's compressed layers use yarn")
    return RopeScaling(
        factor=float(rs["factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast", 32)),
        beta_slow=float(rs.get("beta_slow", 1)),
        attention_factor=1.0,  # frequencies only: no mscale on cos/sin or on the softmax
    )


def _flat_rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    if not d.get("original_seq_len"):
        return None
    return {
        "type": "yarn",
        "factor": d.get("rope_factor", 40),
        "original_max_position_embeddings": d["original_seq_len"],
        "beta_fast": d.get("beta_fast", 32),
        "beta_slow": d.get("beta_slow", 1),
    }
