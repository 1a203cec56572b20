"""Efficiencies: the fraction of a chip's peaks each class of op reaches, and what a launch
costs; fitted on Ferry's measured H100 kernels, or taken from production kernels' published
figures.

``calibrated`` is fitted on part of ``loadtest/results/kernels.json`` (one H100, Ferry's Triton
kernels, bfloat16) and checked on the rest:

==================  =========================================  ====================================
class               fitted on                                  held out
==================  =========================================  ====================================
rms_norm            launch floor: 64 tokens; HBM: the          4,096 tokens
                    measured copy ceiling
add_rms_norm        launch floor: 64 tokens                    4,096 tokens
moe_route           launch floor: 64 tokens                    256, 4,096 tokens
fused_moe           HBM share: 64 tokens; FLOP share: 4,096    256 tokens
mla_decode          batch 64 × context 4,096                   three other batch × context
prefill_attention   4,096 new on 4,096                         1,024 new on 8,192
gemm (cuBLAS)       the measured 8192³ product and copy
other launches      ``small`` model prefill (4 × 2,048)        ``small`` model decode step (64 × 2,048)
==================  =========================================  ====================================

The same fractions are applied to the other chips' datasheet peaks (hardware.py): nothing but
the H100 was measured. The all-to-all and KV transfer shares are not measured on GPUs here:
NCCL all-to-all over NVLink reaches roughly half the link on messages of a decode step (stated
assumption).

``production`` is what vLLM/SGLang-class kernels reach (FP8 weights, FP4 V4 experts, FP8 KV,
fused kernels in CUDA graphs), from published figures: DeepGEMM up to 1,550 FP8 TFLOP/s on
H800 (78% of 1,979); FlashMLA 3,000 GB/s memory-bound and 660 TFLOP/s compute-bound on H800
(90% / 67%); FlashAttention-3 ~600-740 BF16 TFLOP/s on H100 (60-75%); DeepEP 153-158 GB/s
intranode of 160 (one direction of NVLink, ~95%), low-latency kernels a few tens of µs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ferry.infra.simulator.costs import (
    ModelShape,
    MoeLoad,
    Op,
    Precision,
    RankBatch,
    op_seconds,
    step_time,
)
from ferry.infra.simulator.hardware import HARDWARE
from ferry.services.engine.model.presets import PRESETS

KERNELS_JSON = Path(__file__).resolve().parents[2] / "loadtest" / "results" / "kernels.json"
MAX_ERROR = 0.25  # the held-out predictions must be within this of the measurements


@dataclass(frozen=True)
class OpClass:
    bw: float  # fraction of peak HBM bandwidth
    flops: float  # fraction of peak FLOP/s (of the compute dtype)
    floor_s: float  # least time of one eager launch


@dataclass(frozen=True)
class Efficiency:
    name: str
    classes: dict[str, OpClass]
    precision: Precision
    fused: bool = False  # production: one launch per op (fused kernels)
    graph_kernel_s: float = 2e-6  # one kernel inside a CUDA graph
    a2a: float = 0.5  # fraction of one direction of the link an all-to-all reaches
    a2a_latency_s: float = 30e-6  # per dispatch or combine
    kv_transfer: float = 0.7  # fraction of the link a KV transfer reaches
    decode_overhead_s: float = 0.3e-3  # host work per decode step (CUDA graphs replay)
    prefill_overhead_s: float = 1e-3  # host work per prefill step (scheduling, inputs)
    report: dict[str, Any] = field(default_factory=dict, compare=False)


def production() -> Efficiency:
    """Published production-kernel figures (see the module's docstring)."""
    classes = {
        "gemm": OpClass(0.85, 0.75, 4e-6),
        "rms_norm": OpClass(0.8, 1.0, 4e-6),
        "add_rms_norm": OpClass(0.8, 1.0, 4e-6),
        "moe_route": OpClass(0.5, 0.5, 6e-6),
        "fused_moe": OpClass(0.8, 0.65, 6e-6),
        "attn_decode": OpClass(0.85, 0.6, 6e-6),
        "attn_prefill": OpClass(0.85, 0.6, 6e-6),
    }
    return Efficiency(
        "production",
        classes,
        Precision(dense="fp8", experts="fp8", kv="fp8", compute="fp8"),
        fused=True,
        a2a=0.8,
        a2a_latency_s=10e-6,
        kv_transfer=0.8,
    )


# ---- fitting on kernels.json ---------------------------------------------------------------------

H100 = HARDWARE["h100"]


def _rows(data: dict[str, Any]) -> dict[tuple[str, tuple[Any, ...]], dict[str, Any]]:
    return {(r["op"], tuple(r["shape"].values())): r for r in data["results"] if "triton_ms" in r}


def _norm_op(op: str, tokens: int, hidden: int) -> Op:
    tensors = 2 if op == "rms_norm" else 4  # read (and write) x (and the residual)
    return Op(op, op, tensors * tokens * hidden * 2, 4 * tokens * hidden, 1)


def _route_op(tokens: int, experts: int) -> Op:
    return Op("moe_route", "moe_route", tokens * experts * 4, 2 * tokens * experts, 1)


def _fused_moe_op(s: dict[str, int]) -> Op:
    expert = 3 * s["hidden"] * s["moe_intermediate"]
    pairs = s["tokens"] * s["top_k"]
    return Op(
        "fused_moe",
        "fused_moe",
        s["experts_touched"] * expert * 2 + pairs * s["hidden"] * 2 * 2,
        2 * expert * pairs,
        1,
    )


def _mla_decode_op(s: dict[str, int]) -> Op:
    keys = s["batch"] * s["context"]
    dim = s["kv_lora_rank"] + s["rope_dim"]
    flops = 2 * s["heads"] * (dim + s["kv_lora_rank"]) * keys
    return Op("mla_decode", "attn_decode", keys * dim * 2, flops, 1)


def _prefill_attention_op(s: dict[str, int]) -> Op:
    n, prior = s["new_tokens"], s["context"] - s["new_tokens"]
    pairs = n * (prior + (n + 1) / 2)
    flops = 2 * s["heads"] * (s["qk_head_dim"] + s["v_head_dim"]) * pairs
    return Op(
        "prefill_attention", "attn_prefill", s["context"] * s["heads"] * 2 * 2 * 192, flops, 1
    )


def _kernel_op(op: str, shape: dict[str, int]) -> Op:
    if op in ("rms_norm", "add_rms_norm"):
        return _norm_op(op, shape["tokens"], shape["hidden"])
    if op == "moe_route":
        return _route_op(shape["tokens"], shape["experts"])
    if op == "fused_moe":
        return _fused_moe_op(shape)
    if op == "mla_decode":
        return _mla_decode_op(shape)
    if op == "prefill_attention":
        return _prefill_attention_op(shape)
    raise KeyError(op)


def _small_step(eff: Efficiency, sequences: int, context: int, new_tokens: int) -> float:
    """The ``small`` preset's eager forward (no logits) as loadtest/bench_model_kernels.py
    times it: one rank holding every expert."""
    m = ModelShape.from_config(PRESETS["small"].config, "small")
    if new_tokens == 1:
        batch = RankBatch(decode_contexts=[context] * sequences)
    else:
        batch = RankBatch(prefill_chunks=[(new_tokens, context - new_tokens)] * sequences)
    load = MoeLoad(1, batch.tokens, 1.0, m.num_experts)
    return step_time(
        m, eff.precision, H100, eff, [batch], load, eager=True, overhead_s=0.0, logits=False
    ).total_s


def _solve(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = target, f increasing (bisection)."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def calibrate(path: Path = KERNELS_JSON) -> Efficiency:
    """Fit the classes on the calibration rows of ``path``; the report (in ``.report``) lists
    every held-out prediction against its measurement."""
    data = json.loads(Path(path).read_text())
    rows = _rows(data)

    def ms(op: str, *shape: Any) -> float:
        return float(rows[(op, shape)]["triton_ms"]) / 1e3

    ceilings = data["ceilings"]
    hbm = ceilings["measured"]["hbm_GBps"] / (H100.hbm_bytes_s / 1e9)
    gemm = ceilings["measured"]["bf16_dense_TFLOPs"] / (H100.bf16_flops / 1e12)
    moe_small = _fused_moe_op(rows[("fused_moe", (64, 256, 8, 7168, 2048, 97))]["shape"])
    moe_big = _fused_moe_op(rows[("fused_moe", (4096, 256, 8, 7168, 2048, 153))]["shape"])
    mla = _mla_decode_op(rows[("mla_decode", (64, 4096, 128, 512, 64, 64))]["shape"])
    pre = _prefill_attention_op(rows[("prefill_attention", (4096, 4096, 128, 192, 128))]["shape"])
    t_mla, t_pre = (
        ms("mla_decode", 64, 4096, 128, 512, 64, 64),
        ms("prefill_attention", 4096, 4096, 128, 192, 128),
    )

    def classes(launch_s: float) -> dict[str, OpClass]:
        return {
            "gemm": OpClass(hbm, gemm, launch_s),
            "rms_norm": OpClass(hbm, 1.0, ms("rms_norm", 64, 7168)),
            "add_rms_norm": OpClass(hbm, 1.0, ms("add_rms_norm", 64, 7168)),
            "moe_route": OpClass(hbm, 1.0, ms("moe_route", 64, 256, 8)),
            "fused_moe": OpClass(
                moe_small.bytes / (ms("fused_moe", 64, 256, 8, 7168, 2048, 97) * H100.hbm_bytes_s),
                moe_big.flops / (ms("fused_moe", 4096, 256, 8, 7168, 2048, 153) * H100.bf16_flops),
                launch_s,
            ),
            "attn_decode": OpClass(
                mla.bytes / (t_mla * H100.hbm_bytes_s),
                mla.flops / (t_mla * H100.bf16_flops),
                launch_s,
            ),
            "attn_prefill": OpClass(hbm, pre.flops / (t_pre * H100.bf16_flops), launch_s),
        }

    base = Efficiency("calibrated", classes(0.0), Precision())
    prefill_ms = ms("model_prefill", "small", 4, 2048, 2048)

    def prefill_at(launch_s: float) -> float:
        return _small_step(replace(base, classes=classes(launch_s)), 4, 2048, 2048)

    launch = _solve(prefill_at, prefill_ms, 0.0, 1e-3)
    eff = replace(base, classes=classes(launch))
    report = {
        "source": str(path),
        "device": data.get("machine", {}).get("device", ""),
        "fitted": {name: vars(c) for name, c in eff.classes.items()},
        "launch_s": launch,
        "held_out": _held_out(eff, rows),
    }
    errors = [abs(r["error"]) for r in report["held_out"]]
    report["max_abs_error"] = max(errors)
    report["within"] = MAX_ERROR
    return replace(eff, report=report)


HELD_OUT: list[tuple[str, tuple[Any, ...]]] = [
    ("rms_norm", (4096, 7168)),
    ("add_rms_norm", (4096, 7168)),
    ("moe_route", (256, 256, 8)),
    ("moe_route", (4096, 256, 8)),
    ("fused_moe", (256, 256, 8, 7168, 2048, 124)),
    ("mla_decode", (128, 8192, 128, 512, 64, 64)),
    ("mla_decode", (256, 4096, 128, 512, 64, 64)),
    ("mla_decode", (64, 32768, 128, 512, 64, 64)),
    ("prefill_attention", (1024, 8192, 128, 192, 128)),
    ("model_decode_step", ("small", 64, 2048, 1)),
]


def _held_out(
    eff: Efficiency, rows: dict[tuple[str, tuple[Any, ...]], dict[str, Any]]
) -> list[dict[str, Any]]:
    out = []
    for op, shape in HELD_OUT:
        row = rows[(op, shape)]
        if op == "model_decode_step":
            _, sequences, context, new = shape
            predicted = _small_step(eff, sequences, context, new)
        else:
            predicted = op_seconds(_kernel_op(op, row["shape"]), H100, eff, True, "bf16")
        measured = row["triton_ms"] / 1e3
        out.append(
            {
                "op": op,
                "shape": row["shape"],
                "measured_ms": round(measured * 1e3, 4),
                "predicted_ms": round(predicted * 1e3, 4),
                "error": round(predicted / measured - 1, 4),
            }
        )
    return out


def efficiency(name: str, path: Path = KERNELS_JSON) -> Efficiency:
    if name == "calibrated":
        return calibrate(path)
    if name == "production":
        return production()
    raise ValueError(f"unknown efficiency {name!r}; choose calibrated or production")
