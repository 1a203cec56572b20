"""Ops the model calls. Each function resolves its implementation through
:mod:`kernels.dispatch` on every call, so the model never knows which backend ran.
The contracts (shapes, dtypes) are documented on the torch references."""

from __future__ import annotations

import torch

# Importing the backends registers them.
from ferry.kernels import fused_moe as _fused_moe
from ferry.kernels import indexer_topk as _indexer_topk
from ferry.kernels import mla_decode as _mla_decode
from ferry.kernels import mla_prefill as _mla_prefill
from ferry.kernels import moe_routing as _moe_routing
from ferry.kernels import rmsnorm as _rmsnorm
from ferry.kernels import sparse_mqa as _sparse_mqa
from ferry.kernels import v4_compress as _v4_compress
from ferry.kernels.dispatch import get_backend, implementations, resolve, set_backend

_REFERENCES = (
    _fused_moe,
    _indexer_topk,
    _mla_decode,
    _mla_prefill,
    _moe_routing,
    _rmsnorm,
    _sparse_mqa,
    _v4_compress,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out: torch.Tensor = resolve("rms_norm", x.device)(x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = resolve("add_rms_norm", x.device)(x, residual, weight, eps)
    return normed, summed


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    fn = resolve("moe_route", router_logits.device)
    weights, ids = fn(
        router_logits,
        correction_bias,
        top_k,
        n_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
        scoring_func,
    )
    return weights, ids


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts] int64: how many of ``topk_ids`` [num_tokens, top_k] chose each expert."""
    out: torch.Tensor = resolve("expert_counts", topk_ids.device)(topk_ids, num_experts)
    return out


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_slots: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    out: torch.Tensor = resolve("fused_moe", hidden.device)(
        hidden, w13, w2, topk_weights, topk_slots, swiglu_limit
    )
    return out


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    fn = resolve("mla_decode", q.device)
    out: torch.Tensor = fn(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)
    return out


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    out: torch.Tensor = resolve("prefill_attention", q.device)(q, k, v, softmax_scale)
    return out


def sparse_mqa(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    out: torch.Tensor = resolve("sparse_mqa", q.device)(q, kv, indices, sinks, softmax_scale)
    return out


def compress_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = resolve("compress_pool", kv.device)(kv, gate)
    return out


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, num_visible: torch.Tensor, k: int
) -> torch.Tensor:
    out: torch.Tensor = resolve("indexer_topk", q.device)(q, weights, keys, num_visible, k)
    return out


__all__ = [
    "add_rms_norm",
    "compress_pool",
    "expert_counts",
    "fused_moe",
    "get_backend",
    "implementations",
    "indexer_topk",
    "mla_decode",
    "moe_route",
    "prefill_attention",
    "rms_norm",
    "set_backend",
    "sparse_mqa",
]
