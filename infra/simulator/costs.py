"""Per-op roofline of one engine step of a DeepSeek model on one GPU.

A step of one rank (a DP rank of a DEP group, or a single-GPU worker) is a list of ops, each
summed over the layers it runs on. An op moves ``bytes`` through HBM and does ``flops``; it
takes ``max(launches × floor, bytes / (bw × HBM), flops / (flop × peak))`` with the fractions
of its efficiency class (calibration.py). The MoE ops are the group's: they run on the tokens
the all-to-all brings, times the EPLB imbalance (cluster.py), and the all-to-all is a
separate communication time, overlapped with compute under dual-batch overlap.

What is counted per layer (V3: MLA; V4: shared-KV MQA over a sliding window plus compressed
entries):
- ``attn_proj``: the attention projections (V4: and its compressors and indexer query), weights
  read once per step (every DP rank holds them), 2 FLOPs per weight per token;
- ``attn_decode``: absorbed MLA (V3) or sparse MQA (V4) of the decode queries: the KV bytes of
  the keys each query reads, 2 FLOPs per (query, key, dim) for scores and for values;
- ``attn_prefill``: the prefill chunks' attention, causal (V3: expanded through ``kv_b_proj``);
- ``norms``, ``moe_route``: launches and activation bytes;
- ``moe``: the routed experts this rank holds that get a token (weights read once), 2·3·H·I
  FLOPs per routed token; ``shared``/``dense_mlp``: always-on experts and V3's dense layers;
- ``lm_head`` for the rows that sample.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ferry.infra.simulator.hardware import Hardware
from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.full_size import DEEPSEEK_V3, DEEPSEEK_V4_FLASH
from ferry.services.engine.model.registry import AnyModelConfig, config_from_hf_dict
from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v4.config import CSA, HCA, V4ModelConfig
from ferry.services.engine.model.v41.config import V41ModelConfig

if TYPE_CHECKING:
    from ferry.infra.simulator.calibration import Efficiency

MODELS: dict[str, AnyModelConfig] = {
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v4-flash": DEEPSEEK_V4_FLASH,
}
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5}


@dataclass(frozen=True)
class Precision:
    """How weights and the KV cache are stored; compute runs at ``compute``'s FLOP/s."""

    dense: str = "bf16"  # attention, dense MLP, shared experts, lm_head
    experts: str = "bf16"
    kv: str = "bf16"
    compute: str = "bf16"


@dataclass(frozen=True)
class ModelShape:
    """The numbers the roofline needs, derived once from a model config."""

    name: str
    family: str  # "v3" | "v4"
    num_layers: int
    num_moe_layers: int
    hidden: int
    vocab: int
    heads: int
    num_experts: int
    top_k: int
    n_group: int
    expert_params: int  # one routed expert: gate, up, down
    shared_params: int  # per MoE layer
    dense_mlp_params: int  # per dense layer (V3's first layers)
    attn_params: float  # per layer, on average (V4: with compressors and indexer)
    embed_params: int  # embedding + lm_head
    max_context: int
    # V3 (MLA)
    kv_lora_rank: int = 0
    rope_dim: int = 0
    qk_head_dim: int = 0
    v_head_dim: int = 0
    # V4 (sparse MQA)
    head_dim: int = 0
    window: int = 0
    csa_layers: int = 0
    hca_layers: int = 0
    csa_rate: int = 4
    hca_rate: int = 128
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 1

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def total_params(self) -> float:
        return (
            self.num_layers * self.attn_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * (self.num_experts * self.expert_params + self.shared_params)
            + self.embed_params
        )

    @property
    def active_params(self) -> float:
        """Parameters one token goes through (the embedding row aside)."""
        return (
            self.num_layers * self.attn_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * (self.top_k * self.expert_params + self.shared_params)
            + self.embed_params / 2
        )

    def dense_params_per_rank(self) -> float:
        """What every DP rank holds besides its routed experts."""
        return (
            self.num_layers * self.attn_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * self.shared_params
            + self.embed_params
        )

    def kv_bytes_per_token(self, kv: str) -> float:
        """Cache bytes per token of history, all layers (V4: the full-history groups)."""
        if self.family == "v3":
            # fp8 as vLLM's fp8_ds_mla stores it: 512 fp8 values, 4 fp32 scales, 64 bf16 rope
            per_layer = 656.0 if kv == "fp8" else (self.kv_lora_rank + self.rope_dim) * 2.0
            return per_layer * self.num_layers
        # CSA entries + indexer keys every csa_rate tokens, HCA entries every hca_rate
        entry = self._v4_entry_bytes(kv)
        index_key = self.index_dim * (1.03 if kv == "fp8" else 2.0)
        csa = self.csa_layers * (entry + index_key) / self.csa_rate
        return csa + self.hca_layers * entry / self.hca_rate

    def state_bytes_per_request(self, kv: str) -> float:
        """V4's fixed per-request state: the sliding-window ring of every layer and the
        compressors' partial windows (deepseek-v4.md §2); none for V3."""
        if self.family == "v3":
            return 0.0
        ring = self.num_layers * self.window * self._v4_entry_bytes(kv)
        return ring + 5.3 * 2**20 * (0.5 if kv == "fp8" else 1.0)

    def _v4_entry_bytes(self, kv: str) -> float:
        # fp8: 448 fp8 nope values, 64 bf16 rope values, scales (vLLM's 584-byte layout)
        return 584.0 if kv == "fp8" else self.head_dim * 2.0

    @classmethod
    def from_config(cls, config: AnyModelConfig, name: str) -> ModelShape:
        if isinstance(config, V41ModelConfig):
            raise ConfigError(f"{name}: the simulator has no DeepSeek-V4.1 cost model yet")
        if isinstance(config, V4ModelConfig):
            return _v4_shape(config, name)
        return _v3_shape(config, name)


def _v3_shape(c: ModelConfig, name: str) -> ModelShape:
    h, heads = c.hidden_size, c.num_attention_heads
    q = (
        h * c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
        if c.q_lora_rank
        else h * heads * c.qk_head_dim
    )
    attn = (
        q
        + h * c.kv_cache_dim
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        + heads * c.v_head_dim * h
    )
    expert = 3 * h * c.moe_intermediate_size
    return ModelShape(
        name=name,
        family="v3",
        num_layers=c.num_hidden_layers,
        num_moe_layers=c.num_moe_layers,
        hidden=h,
        vocab=c.vocab_size,
        heads=heads,
        num_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok,
        n_group=c.n_group,
        expert_params=expert,
        shared_params=expert * c.n_shared_experts,
        dense_mlp_params=3 * h * c.intermediate_size,
        attn_params=float(attn),
        embed_params=2 * c.vocab_size * h,
        max_context=c.max_position_embeddings,
        kv_lora_rank=c.kv_lora_rank,
        rope_dim=c.qk_rope_head_dim,
        qk_head_dim=c.qk_head_dim,
        v_head_dim=c.v_head_dim,
    )


def _v4_shape(c: V4ModelConfig, name: str) -> ModelShape:
    h, heads, d = c.hidden_size, c.num_attention_heads, c.head_dim
    csa = sum(t == CSA for t in c.layer_types)
    hca = sum(t == HCA for t in c.layer_types)
    base = (
        h * c.q_lora_rank
        + c.q_lora_rank * heads * d
        + h * d
        + heads * d * c.o_lora_rank
        + c.o_groups * c.o_lora_rank * h
    )
    csa_extra = (
        4 * h * d  # compressor kv + gate, two series
        + c.q_lora_rank * c.index_n_heads * c.index_head_dim
        + h * c.index_n_heads
        + 4 * h * c.index_head_dim
    )
    hca_extra = 2 * h * d
    attn = base + (csa * csa_extra + hca * hca_extra) / c.num_hidden_layers
    expert = 3 * h * c.moe_intermediate_size
    return ModelShape(
        name=name,
        family="v4",
        num_layers=c.num_hidden_layers,
        num_moe_layers=c.num_moe_layers,
        hidden=h,
        vocab=c.vocab_size,
        heads=heads,
        num_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok,
        n_group=1,
        expert_params=expert,
        shared_params=expert * c.n_shared_experts,
        dense_mlp_params=0,
        attn_params=attn,
        embed_params=2 * c.vocab_size * h,
        max_context=c.max_position_embeddings,
        head_dim=d,
        window=c.sliding_window,
        csa_layers=csa,
        hca_layers=hca,
        csa_rate=c.csa_rate,
        hca_rate=c.hca_rate,
        index_heads=c.index_n_heads,
        index_dim=c.index_head_dim,
        index_topk=c.index_topk,
        hc_mult=c.hc_mult,
    )


def load_model(name_or_path: str) -> ModelShape:
    """A known model's shapes, or those of a HF config.json (model_type deepseek_v3 or
    deepseek_v4; a directory holding one works too). ValueError with the reason otherwise."""
    if name_or_path in MODELS:
        return ModelShape.from_config(MODELS[name_or_path], name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model {name_or_path!r}: not one of {', '.join(MODELS)} and no config.json there"
        )
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        config = config_from_hf_dict(raw, source=str(path))
    except Exception as exc:  # a ConfigError, a missing field, bad JSON: all say what is wrong
        raise ValueError(f"model {name_or_path!r}: {exc}") from exc
    return ModelShape.from_config(config, path.parent.name or str(path))


# ---- one step's work ---------------------------------------------------------------------------


@dataclass
class RankBatch:
    """What one rank computes in a step: decode queries by context length, prefill chunks as
    (new tokens, tokens before them)."""

    decode_contexts: list[int] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.decode_contexts) + sum(n for n, _ in self.prefill_chunks)

    @property
    def logit_rows(self) -> int:
        return len(self.decode_contexts) + len(self.prefill_chunks)


@dataclass(frozen=True)
class MoeLoad:
    """The MoE side of a step, which the DEP group shares: its size, the tokens its ranks bring
    on average, the EPLB imbalance (max over mean expert-token load per GPU), and the routed
    expert slots each GPU holds."""

    dep: int
    tokens_per_rank: float
    imbalance: float
    slots_per_rank: int


class Op(NamedTuple):
    name: str
    cls: str  # efficiency class (calibration.py)
    bytes: float
    flops: float
    launches: float  # kernel launches as Ferry's eager forward makes them
    fused: float = 1.0  # launches of a fused production kernel set


def attention_ops(m: ModelShape, p: Precision, b: RankBatch) -> list[Op]:
    """The attention part of every layer for this rank's own batch (norms included)."""
    t, L, h = b.tokens, m.num_layers, m.hidden
    w = DTYPE_BYTES[p.dense]
    act = DTYPE_BYTES["bf16"]
    spans = len(b.prefill_chunks)
    ops = [
        # the q and kv latents' norms (narrower than hidden: counted at hidden), read + write
        Op("rms_norm", "rms_norm", 2 * L * t * h * 2 * act, 2 * L * t * h * 4, 2 * L),
        # the residual adds: read x and the residual, write both
        Op("add_rms_norm", "add_rms_norm", 2 * L * t * h * 4 * act, 2 * L * t * h * 5, 2 * L),
        # projections, rope (7 elementwise ops per apply), cache write, absorb einsums, cats
        Op("attn_proj", "gemm", L * m.attn_params * w, 2 * L * t * m.attn_params, 27 * L, 3 * L),
    ]
    if b.decode_contexts:
        ops.append(_decode_attention(m, p, b.decode_contexts))
    if b.prefill_chunks:
        ops.extend(_prefill_attention(m, p, b.prefill_chunks))
        # per chunk: gather its cache rows, expand, cat k and q, copy its output back
        ops.append(Op("prefill_glue", "gemm", 0.0, 0.0, 5 * L * spans, 0.0))
    return ops


def _decode_attention(m: ModelShape, p: Precision, contexts: list[int]) -> Op:
    L = m.num_layers
    if m.family == "v3":
        keys = float(sum(contexts))
        key_bytes = m.kv_bytes_per_token(p.kv) / L
        flops = 2 * m.heads * (2 * m.kv_lora_rank + m.rope_dim) * keys
        return Op("attn_decode", "attn_decode", L * keys * key_bytes, L * flops, 2 * L)
    swa = sum(min(c, m.window) for c in contexts)
    csa = sum(min(m.index_topk, c // m.csa_rate) for c in contexts)
    hca = sum(c // m.hca_rate for c in contexts)
    indexed = sum(c // m.csa_rate for c in contexts)
    keys = L * swa + m.csa_layers * csa + m.hca_layers * hca
    entry = m._v4_entry_bytes(p.kv)
    index_bytes = m.csa_layers * indexed * m.index_dim * (1.03 if p.kv == "fp8" else 2.0)
    flops = 4 * m.heads * m.head_dim * keys + m.csa_layers * 2 * m.index_heads * m.index_dim * (
        indexed
    )
    return Op("attn_decode", "attn_decode", keys * entry + index_bytes, flops, 3 * L)


def _prefill_attention(m: ModelShape, p: Precision, chunks: list[tuple[int, int]]) -> list[Op]:
    L = m.num_layers
    if m.family == "v3":
        pairs = sum(n * (prior + (n + 1) / 2) for n, prior in chunks)
        flops = 2 * m.heads * (m.qk_head_dim + m.v_head_dim) * pairs
        # the cache rows are expanded through kv_b_proj for every key a chunk attends to
        keys = sum(n + prior for n, prior in chunks)
        kv_b = m.kv_lora_rank * m.heads * (m.qk_head_dim - m.rope_dim + m.v_head_dim)
        key_bytes = keys * m.kv_bytes_per_token(p.kv) / L
        return [
            Op("attn_prefill", "attn_prefill", L * key_bytes, L * flops, L * len(chunks)),
            Op("kv_expand", "gemm", L * kv_b * DTYPE_BYTES[p.dense], L * 2 * kv_b * keys, 0, 0),
        ]
    # a chunk's queries see prior + n/2 tokens on average
    mid = [(n, prior + n / 2) for n, prior in chunks]
    swa = sum(n * min(c, float(m.window)) for n, c in mid)
    csa = sum(n * min(float(m.index_topk), c / m.csa_rate) for n, c in mid)
    hca = sum(n * c / m.hca_rate for n, c in mid)
    attended = L * swa + m.csa_layers * csa + m.hca_layers * hca
    index_pairs = sum(n * c / m.csa_rate for n, c in mid)
    flops = 4 * m.heads * m.head_dim * attended
    flops += m.csa_layers * 2 * m.index_heads * m.index_dim * index_pairs
    history = sum(n + prior for n, prior in chunks) * m.kv_bytes_per_token(p.kv)
    return [Op("attn_prefill", "attn_prefill", history, flops, 2 * L * len(chunks))]


def moe_ops(m: ModelShape, p: Precision, t: int, load: MoeLoad) -> list[Op]:
    """The MoE layers of a rank whose own batch has ``t`` tokens, in a group loaded as
    ``load`` says; and V3's dense layers."""
    Lm, h = m.num_moe_layers, m.hidden
    w = DTYPE_BYTES[p.dense]
    routed = load.tokens_per_rank * m.top_k * load.imbalance  # token-expert pairs on this GPU
    choices = load.tokens_per_rank * load.dep * m.top_k
    touched = load.slots_per_rank * (1 - math.exp(-choices / (m.num_experts * 1.0)))
    expert_bytes = touched * m.expert_params * DTYPE_BYTES[p.experts]
    ops = [
        Op("moe_route", "moe_route", Lm * t * m.num_experts * 4, Lm * t * m.num_experts * 2, Lm),
        Op("router", "gemm", Lm * h * m.num_experts * 4, 2 * Lm * t * h * m.num_experts, 2 * Lm, 0),
        Op(
            "moe",
            "fused_moe",
            Lm * (expert_bytes + routed * h * 2 * 2),
            Lm * 2 * m.expert_params * routed,
            7 * Lm,
        ),
        Op("shared", "gemm", Lm * m.shared_params * w, 2 * Lm * t * m.shared_params, 6 * Lm, Lm),
    ]
    if m.num_dense_layers:
        Ld = m.num_dense_layers
        ops.append(
            Op(
                "dense_mlp",
                "gemm",
                Ld * m.dense_mlp_params * w,
                2 * Ld * t * m.dense_mlp_params,
                5 * Ld,
                Ld,
            )
        )
    return ops


def head_ops(m: ModelShape, p: Precision, b: RankBatch) -> list[Op]:
    """Embedding, the final norm and the logits of the rows that sample."""
    rows = b.logit_rows
    return [
        Op("embed", "gemm", b.tokens * m.hidden * 2, 0.0, 6, 1),
        Op(
            "lm_head",
            "gemm",
            m.vocab * m.hidden * DTYPE_BYTES[p.dense] if rows else 0.0,
            2 * rows * m.vocab * m.hidden,
            2 if rows else 0,
        ),
    ]


def all_to_all_bytes(m: ModelShape, p: Precision, load: MoeLoad) -> float:
    """Bytes one GPU receives per step over all MoE layers (dispatch in the compute dtype's
    activations, combine in bf16), the busiest GPU's share."""
    if load.dep <= 1:
        return 0.0
    remote = (load.dep - 1) / load.dep
    per_pair = m.hidden * (DTYPE_BYTES[p.compute] + 2.0)
    return m.num_moe_layers * load.tokens_per_rank * m.top_k * per_pair * remote * load.imbalance


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    overhead_s: float
    total_s: float
    ops: dict[str, float]

    def breakdown(self) -> dict[str, float]:
        return {**self.ops, "all_to_all": self.comm_s, "overhead": self.overhead_s}


def op_seconds(op: Op, hw: Hardware, eff: Efficiency, eager: bool, compute: str) -> float:
    """One op's time: launch floor, memory time or compute time, whichever is longest.
    ``eager``: launched one by one from the host (each
    launch costs its class's floor), else from a CUDA graph (``graph_kernel_s`` each)."""
    c = eff.classes[op.cls]
    launches = op.fused if eff.fused else op.launches
    floor = launches * (c.floor_s if eager else eff.graph_kernel_s)
    # attention runs in bf16 whatever the weights are stored in
    low = compute != "bf16" and not op.cls.startswith("attn")
    peak = hw.fp8_flops if low else hw.bf16_flops
    mem = op.bytes / (c.bw * hw.hbm_bytes_s) if op.bytes else 0.0
    flops = op.flops / (c.flops * peak) if op.flops else 0.0
    return max(floor, mem, flops)


def step_time(
    m: ModelShape,
    p: Precision,
    hw: Hardware,
    eff: Efficiency,
    batches: list[RankBatch],
    load: MoeLoad,
    *,
    eager: bool,
    overhead_s: float,
    dbo: bool = False,
    logits: bool = True,
) -> StepTime:
    """One lockstep step of ``batches`` (the ranks of a group that are simulated): the slowest
    rank's own ops, the group's MoE, and the all-to-all (under dual-batch overlap, hidden
    behind compute but for one layer's share)."""
    ops: dict[str, float] = {}
    slowest = 0.0
    for b in batches:
        rank_ops = attention_ops(m, p, b) + (head_ops(m, p, b) if logits else [])
        times = {op.name: op_seconds(op, hw, eff, eager, p.compute) for op in rank_ops}
        if sum(times.values()) > slowest:
            slowest, ops = sum(times.values()), times
    t = max((b.tokens for b in batches), default=0)
    moe = {op.name: op_seconds(op, hw, eff, eager, p.compute) for op in moe_ops(m, p, t, load)}
    ops |= moe
    compute = slowest + sum(moe.values())
    comm = 0.0
    if load.dep > 1:
        link = eff.a2a * hw.all_to_all_bytes_s(load.dep)
        comm = all_to_all_bytes(m, p, load) / link + 2 * m.num_moe_layers * eff.a2a_latency_s
    if dbo and t >= 2 and comm:
        busy = max(compute, comm) + comm / m.num_moe_layers
    else:
        busy = compute + comm
    return StepTime(compute, comm, overhead_s, busy + overhead_s, ops)
