"""Kernel benchmark: every Triton kernel against its torch reference at DeepSeek-V3's shapes,
and DeepSeek-V4-Flash's for V4's ops (sparse_mqa, compress_pool, indexer_topk).

    python -m ferry.kernels.bench                # on a CUDA GPU; writes loadtest/results/kernels.json
    python -m ferry.kernels.bench --only mla_decode fused_moe
    TRITON_INTERPRET=1 python -m ferry.kernels.bench --tiny   # tiny shapes on the CPU: checks it

Each case first checks the Triton output against the torch reference, run in float32 on the same
(bfloat16) inputs: max error within 1e-2 of the reference's largest value; routing, the same
experts for every token. (The bfloat16 reference rounds its intermediates, scores and per-expert
outputs, to bfloat16 and strays further from float32 than the kernels do.) Then it times both
with ``triton.testing.do_bench`` (median, L2 flushed between runs) and reports the achieved HBM
bandwidth and tensor throughput, and the fraction of the roofline (the larger of bytes /
bandwidth and flops / peak) reached. The roofline uses the ceilings measured on the card at the
start (a 2 GiB device-to-device copy, bytes read plus written; an 8192³ bfloat16 matrix product on
random data); the H200's datasheet figures, and the card's own where known, are printed and
recorded beside them. The whole model on each backend is ``loadtest/bench_model_kernels.py``
(the kernels know nothing of the engine).

Without a CUDA device (and without ``--tiny``) it says so and exits 0. A case that fails, even
by raising (a kernel that does not build, out of memory), is reported and the run goes on; the
exit status is 1 if any check failed. The JSON is rewritten after every case (``"complete":
false`` until the last), so a run cut short still leaves what it measured.

On a GPU machine that has torch and Triton but not this project's other packages (the device
machines here), ``pip install --no-deps -e .`` in the repository first (the kernels need nothing
else), then ``python3 -m ferry.kernels.bench --out "$OUT/kernels.json"``. Every case is sized to
take seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from ferry.kernels import dispatch


@dataclass(frozen=True)
class Ceilings:
    """HBM bandwidth (bytes/s, read plus written) and dense bfloat16 tensor throughput (flop/s)."""

    hbm: float
    bf16: float

    def as_json(self) -> dict[str, float]:
        return {"hbm_GBps": round(self.hbm / 1e9), "bf16_dense_TFLOPs": round(self.bf16 / 1e12)}


H200 = Ceilings(hbm=4.8e12, bf16=989e12)
DATASHEETS = {"H200": H200, "H100 80GB HBM3": Ceilings(hbm=3.35e12, bf16=989e12)}  # SXM parts
BF16_TOLERANCE = 1e-2
DEFAULT_OUT = "loadtest/results/kernels.json"
DEVICE = torch.device("cuda")  # main() picks the CPU for --tiny without a GPU


@dataclass(frozen=True)
class Shapes:
    """The model dimensions and the batch sizes benchmarked."""

    hidden: int
    heads: int
    kv_lora_rank: int
    rope_dim: int
    qk_head_dim: int
    v_head_dim: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    moe_inter: int
    block_size: int
    norm_tokens: tuple[int, ...]
    moe_tokens: tuple[int, ...]
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    prefill: tuple[tuple[int, int], ...]  # (new tokens, context)


DEEPSEEK_V3 = Shapes(
    hidden=7168,
    heads=128,
    kv_lora_rank=512,
    rope_dim=64,
    qk_head_dim=192,
    v_head_dim=128,
    experts=256,
    top_k=8,
    n_group=8,
    topk_group=4,
    moe_inter=2048,
    block_size=64,
    norm_tokens=(64, 4096),
    moe_tokens=(64, 256, 4096),
    decode=((64, 4096), (128, 8192), (256, 4096), (64, 32768)),
    prefill=((4096, 4096), (1024, 8192)),
)
TINY = Shapes(
    hidden=64,
    heads=4,
    kv_lora_rank=32,
    rope_dim=16,
    qk_head_dim=24,
    v_head_dim=16,
    experts=16,
    top_k=4,
    n_group=4,
    topk_group=2,
    moe_inter=32,
    block_size=16,
    norm_tokens=(8,),
    moe_tokens=(12,),
    decode=((3, 40),),
    prefill=((20, 36),),
)


@dataclass(frozen=True)
class V4Shapes:
    """DeepSeek-V4's attention dimensions and the batches benchmarked."""

    heads: int
    head_dim: int
    window: int
    index_heads: int
    index_dim: int
    index_topk: int
    csa_rate: int
    hca_rate: int
    decode: tuple[tuple[int, int], ...]  # (batch, compressed entries each query may see)
    prefill: tuple[tuple[int, int], ...]  # (new tokens, compressed entries of the context)


DEEPSEEK_V4_FLASH = V4Shapes(
    heads=64,
    head_dim=512,
    window=128,
    index_heads=64,
    index_dim=128,
    index_topk=512,
    csa_rate=4,
    hca_rate=128,
    decode=((64, 8192), (128, 32768)),
    prefill=((4096, 2048),),
)
TINY_V4 = V4Shapes(
    heads=4,
    head_dim=48,
    window=8,
    index_heads=4,
    index_dim=16,
    index_topk=8,
    csa_rate=4,
    hca_rate=16,
    decode=((3, 40),),
    prefill=((12, 20),),
)


@dataclass
class Case:
    """One op at one shape: its inputs, the minimum HBM traffic and the flops it needs, and
    how to compare its outputs (returns the error; raises AssertionError past tolerance)."""

    op: str
    shape: dict[str, int]
    args: tuple[Any, ...]
    bytes: float
    flops: float
    compare: Callable[[Any, Any], float]


# ---- comparisons -----------------------------------------------------------------------------


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.float(), ref.float()
    if not torch.isfinite(ours).all():
        raise AssertionError("non-finite values in the Triton output")
    return float((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def close(tolerance: float) -> Callable[[Any, Any], float]:
    def compare(ours: Any, ref: Any) -> float:
        pairs = zip(ours, ref, strict=True) if isinstance(ours, tuple) else [(ours, ref)]
        err = max(rel_err(a, b) for a, b in pairs)
        if err > tolerance:
            raise AssertionError(f"relative error {err:.2e} > {tolerance:.0e}")
        return err

    return compare


def same_experts(ours: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float:
    """Routing: the same set of experts per token (the reference's order is unspecified), and
    the weights, matched by expert id, within float32 tolerance."""
    (w, ids), (ref_w, ref_ids) = ours, ref
    ids, order = ids.sort(dim=1)
    ref_ids, ref_order = ref_ids.sort(dim=1)
    if not torch.equal(ids, ref_ids):
        differ = int((ids != ref_ids).any(dim=1).sum())
        raise AssertionError(f"{differ} of {ids.shape[0]} tokens routed to other experts")
    return close(1e-5)(w.gather(1, order), ref_w.gather(1, ref_order))


# ---- the cases -------------------------------------------------------------------------------


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype) * scale


def norm_cases(s: Shapes) -> Iterator[Case]:
    for tokens in s.norm_tokens:
        x, res, w = _randn(tokens, s.hidden), _randn(tokens, s.hidden), _randn(s.hidden)
        shape = {"tokens": tokens, "hidden": s.hidden}
        size = tokens * s.hidden * 2  # bytes of one [tokens, hidden] tensor
        yield Case(
            op="rms_norm",
            shape=shape,
            args=(x, w, 1e-6),
            bytes=2 * size,
            flops=4 * tokens * s.hidden,
            compare=close(BF16_TOLERANCE),
        )
        yield Case(
            op="add_rms_norm",
            shape=shape,
            args=(x, res, w, 1e-6),
            bytes=4 * size,
            flops=5 * tokens * s.hidden,
            compare=close(BF16_TOLERANCE),
        )


def _route(s: Shapes, tokens: int) -> tuple[Any, ...]:
    logits = torch.randn(tokens, s.experts, device=DEVICE) * 2
    bias = torch.randn(s.experts, device=DEVICE) * 0.1
    return (logits, bias, s.top_k, s.n_group, s.topk_group, True, 2.5)


def route_cases(s: Shapes) -> Iterator[Case]:
    for tokens in s.moe_tokens:
        yield Case(
            op="moe_route",
            shape={"tokens": tokens, "experts": s.experts, "top_k": s.top_k},
            args=_route(s, tokens),
            bytes=tokens * s.experts * 4 + tokens * s.top_k * (4 + 8),
            flops=10 * tokens * s.experts,
            compare=same_experts,
        )


def moe_cases(s: Shapes) -> Iterator[Case]:
    """All experts of one layer on this GPU, tokens routed by the real routing function."""
    w13 = _randn(s.experts, 2 * s.moe_inter, s.hidden, scale=0.02)
    w2 = _randn(s.experts, s.hidden, s.moe_inter, scale=0.02)
    route = dispatch.implementation("moe_route", "torch")
    per_expert = 3 * s.moe_inter * s.hidden * 2  # bytes of one expert's weights
    for tokens in s.moe_tokens:
        weights, ids = route(*_route(s, tokens))
        touched = int(torch.unique(ids).numel())
        yield Case(
            op="fused_moe",
            shape={
                "tokens": tokens,
                "experts": s.experts,
                "top_k": s.top_k,
                "hidden": s.hidden,
                "moe_intermediate": s.moe_inter,
                "experts_touched": touched,
            },
            args=(_randn(tokens, s.hidden), w13, w2, weights, ids),
            bytes=touched * per_expert + 2 * tokens * s.hidden * 2,
            flops=2 * tokens * s.top_k * 3 * s.hidden * s.moe_inter,
            compare=close(BF16_TOLERANCE),
        )


def decode_cases(s: Shapes) -> Iterator[Case]:
    dim = s.kv_lora_rank + s.rope_dim
    for batch, context in s.decode:
        per_seq = math.ceil(context / s.block_size)
        cache = _randn(batch * per_seq, s.block_size, dim)  # scattered blocks, full contexts
        tables = torch.randperm(batch * per_seq, device=DEVICE).view(batch, per_seq)
        lens = torch.full((batch,), context, dtype=torch.long, device=DEVICE)
        q = _randn(batch, s.heads, dim)
        yield Case(
            op="mla_decode",
            shape={
                "batch": batch,
                "context": context,
                "heads": s.heads,
                "kv_lora_rank": s.kv_lora_rank,
                "rope_dim": s.rope_dim,
                "block_size": s.block_size,
            },
            args=(q, cache, tables, lens, s.qk_head_dim**-0.5, s.kv_lora_rank),
            bytes=batch * context * dim * 2 + batch * s.heads * (dim + s.kv_lora_rank) * 2,
            flops=2 * batch * s.heads * context * (dim + s.kv_lora_rank),
            compare=close(BF16_TOLERANCE),
        )


def prefill_cases(s: Shapes) -> Iterator[Case]:
    for q_len, context in s.prefill:
        q = _randn(q_len, s.heads, s.qk_head_dim).transpose(0, 1)  # as the model passes them
        k = _randn(context, s.heads, s.qk_head_dim).transpose(0, 1)
        v = _randn(context, s.heads, s.v_head_dim).transpose(0, 1)
        pairs = q_len * (context - q_len) + q_len * (q_len + 1) // 2  # causal (query, key) pairs
        elems = (q_len + context) * (s.qk_head_dim + s.v_head_dim)  # q, k, v and the output
        yield Case(
            op="prefill_attention",
            shape={
                "new_tokens": q_len,
                "context": context,
                "heads": s.heads,
                "qk_head_dim": s.qk_head_dim,
                "v_head_dim": s.v_head_dim,
            },
            args=(q, k, v, s.qk_head_dim**-0.5),
            bytes=s.heads * elems * 2,
            flops=2 * s.heads * pairs * (s.qk_head_dim + s.v_head_dim),
            compare=close(BF16_TOLERANCE),
        )


def _distinct(rows: int, k: int, count: int) -> torch.Tensor:
    """[rows, k] distinct ids below ``count`` per row (k <= count)."""
    return torch.rand(rows, count, device=DEVICE).topk(k, dim=1).indices


def sparse_mqa_cases(s: V4Shapes) -> Iterator[Case]:
    """Decode: each query its own window rows and index_topk entries out of a pool of its
    own; prefill: every query of a chunk the same pool (its window and picks differ)."""
    k = s.window + s.index_topk
    scale = s.head_dim**-0.5
    for batch, entries in s.decode:
        pool = s.window + entries
        kv = _randn(batch * pool, s.head_dim)
        own = _distinct(batch, k, pool) + torch.arange(batch, device=DEVICE)[:, None] * pool
        yield Case(
            op="sparse_mqa",
            shape={"queries": batch, "heads": s.heads, "head_dim": s.head_dim, "k": k},
            args=(_randn(batch, s.heads, s.head_dim), kv, own, _randn(s.heads).float(), scale),
            bytes=batch * (k * s.head_dim + 2 * s.heads * s.head_dim) * 2,
            flops=4 * batch * s.heads * k * s.head_dim,
            compare=close(BF16_TOLERANCE),
        )
    for tokens, entries in s.prefill:
        pool = tokens + entries
        yield Case(
            op="sparse_mqa",
            shape={
                "queries": tokens,
                "heads": s.heads,
                "head_dim": s.head_dim,
                "k": k,
                "pool": pool,
            },
            args=(
                _randn(tokens, s.heads, s.head_dim),
                _randn(pool, s.head_dim),
                _distinct(tokens, k, pool),
                _randn(s.heads).float(),
                scale,
            ),
            bytes=(pool * s.head_dim + 2 * tokens * s.heads * s.head_dim) * 2,
            flops=4 * tokens * s.heads * k * s.head_dim,
            compare=close(BF16_TOLERANCE),
        )


def compress_cases(s: V4Shapes) -> Iterator[Case]:
    """The entries a prefill chunk emits: CSA windows (2 x rate rows with the overlap), HCA."""
    for tokens, _ in s.prefill:
        for rows, entries in (
            (2 * s.csa_rate, tokens // s.csa_rate),
            (s.hca_rate, max(1, tokens // s.hca_rate)),
        ):
            kv, gate = _randn(entries, rows, s.head_dim), _randn(entries, rows, s.head_dim)
            yield Case(
                op="compress_pool",
                shape={"entries": entries, "rows": rows, "width": s.head_dim},  # rows: CSA or HCA
                args=(kv, gate),
                bytes=(2 * rows + 1) * entries * s.head_dim * 2,
                flops=5 * entries * rows * s.head_dim,
                compare=close(BF16_TOLERANCE),
            )


def same_picks(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The indexer: the share of (query, pick) the two disagree on, as sets (bfloat16 scores
    can swap near-equal entries at the k-th place); at most 1%."""
    shared = sum(
        sum((Counter(a) & Counter(b)).values())  # -1 may repeat: count it as often
        for a, b in zip(ours.tolist(), ref.tolist(), strict=True)
    )
    missing = 1.0 - shared / ref.numel()
    if missing > 0.01:
        raise AssertionError(f"{missing:.2%} of the picks differ")
    return missing


def indexer_cases(s: V4Shapes) -> Iterator[Case]:
    h, d, k = s.index_heads, s.index_dim, s.index_topk
    for batch, entries in s.decode:
        keys = _randn(batch, entries, d)
        visible = torch.randint(entries // 2, entries + 1, (batch,), device=DEVICE)
        yield Case(
            op="indexer_topk",
            shape={"queries": batch, "heads": h, "dim": d, "entries": entries, "k": k},
            args=(_randn(batch, h, d), torch.rand(batch, h, device=DEVICE), keys, visible, k),
            bytes=batch * entries * d * 2,
            flops=2 * batch * h * entries * d,
            compare=same_picks,
        )
    for tokens, entries in s.prefill:
        keys = _randn(entries, d)
        visible = torch.linspace(1, entries, tokens, device=DEVICE).long()  # a causal chunk
        yield Case(
            op="indexer_topk",
            shape={"queries": tokens, "heads": h, "dim": d, "entries": entries, "k": k},
            args=(_randn(tokens, h, d), torch.rand(tokens, h, device=DEVICE), keys, visible, k),
            bytes=entries * d * 2 + tokens * h * d * 2,
            flops=tokens * h * entries * d,  # half the pairs are visible
            compare=same_picks,
        )


def _v3(cases: Callable[[Shapes], Iterator[Case]]) -> Callable[[bool], Iterator[Case]]:
    return lambda tiny: cases(TINY if tiny else DEEPSEEK_V3)


def _v4(cases: Callable[[V4Shapes], Iterator[Case]]) -> Callable[[bool], Iterator[Case]]:
    return lambda tiny: cases(TINY_V4 if tiny else DEEPSEEK_V4_FLASH)


# suite -> its cases at the tiny shapes (True) or the real model's: DeepSeek-V3, V4-Flash
SUITES: dict[str, Callable[[bool], Iterator[Case]]] = {
    "rms_norm": _v3(norm_cases),
    "moe_route": _v3(route_cases),
    "fused_moe": _v3(moe_cases),
    "mla_decode": _v3(decode_cases),
    "prefill_attention": _v3(prefill_cases),
    "sparse_mqa": _v4(sparse_mqa_cases),
    "compress_pool": _v4(compress_cases),
    "indexer_topk": _v4(indexer_cases),
}


# ---- running ---------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds per call: do_bench on CUDA, wall-clock runs elsewhere."""
    if DEVICE.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    runs = []
    for _ in range(1 if dispatch.interpreting() else 3):  # interpreted: checks the script only
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def _float32(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def failure(exc: Exception) -> dict[str, Any]:
    """A row's verdict for an exception: an AssertionError is a check that failed; anything else
    is an implementation that did not run (a build error, out of memory), named by its type."""
    if isinstance(exc, AssertionError):
        return {"ok": False, "error": str(exc)}
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}".strip()[:2000]}


def measure_ceilings() -> Ceilings:
    """What this card reaches: a 2 GiB copy (bytes read plus written) and an 8192³ bfloat16
    product of random matrices, each the median of do_bench's runs."""
    src = torch.randn(2**30 // 2, device=DEVICE, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = time_ms(functools.partial(dst.copy_, src))
    hbm = 2 * src.numel() * src.element_size() / copy_ms * 1e3
    del src, dst
    n = 8192
    a, b = _randn(n, n), _randn(n, n)
    bf16 = 2 * n**3 / time_ms(lambda: a @ b) * 1e3
    return Ceilings(hbm=hbm, bf16=bf16)


def datasheet(device_name: str) -> Ceilings | None:
    return next((c for name, c in DATASHEETS.items() if name in device_name), None)


def run_case(case: Case, ceilings: Ceilings) -> dict[str, Any]:
    reference = dispatch.implementation(case.op, "torch")
    row: dict[str, Any] = {"op": case.op, "shape": case.shape}
    try:
        kernel = dispatch.implementation(case.op, "triton")
        ours = kernel(*case.args)
    except Exception as exc:  # nothing to time: report it and go on with the other cases
        return row | failure(exc)
    try:
        row["max_rel_err"] = case.compare(ours, reference(*_float32(case.args)))
        row["ok"] = True
    except Exception as exc:  # a wrong answer is still timed
        row |= failure(exc)
    del ours
    try:
        torch_ms = time_ms(lambda: reference(*case.args))
        triton_ms = time_ms(lambda: kernel(*case.args))
    except Exception as exc:
        return row | failure(exc)
    roofline_ms = max(case.bytes / ceilings.hbm, case.flops / ceilings.bf16) * 1e3
    row.update(
        torch_ms=torch_ms,
        triton_ms=triton_ms,
        speedup=torch_ms / triton_ms,
        bytes=case.bytes,
        flops=case.flops,
        triton_GBps=case.bytes / triton_ms / 1e6,
        triton_TFLOPs=case.flops / triton_ms / 1e9,
        roofline_ms=roofline_ms,
        of_roofline=roofline_ms / triton_ms,
    )
    return row


# ---- output ----------------------------------------------------------------------------------


def _print_row(row: dict[str, Any], ceilings: Ceilings) -> None:
    shape = " ".join(f"{k}={v}" for k, v in row["shape"].items())
    check = f"err {row['max_rel_err']:.1e}" if "max_rel_err" in row else "timed"
    check = check if row["ok"] else f"FAILED: {row['error']}"
    line = f"{row['op']:18s} {shape}\n   "
    if "triton_ms" in row:
        line += (
            f" torch {row['torch_ms']:9.3f} ms   triton {row['triton_ms']:9.3f} ms "
            f"({row['speedup']:5.1f}x)  "
        )
    if "triton_GBps" in row:
        line += (
            f" {row['triton_GBps']:7.0f} GB/s of {ceilings.hbm / 1e9:.0f}  "
            f" {row['triton_TFLOPs']:6.1f} TFLOP/s of {ceilings.bf16 / 1e12:.0f}  "
            f" {100 * row['of_roofline']:5.1f}% of roofline  "
        )
    print(f"{line} {check}", flush=True)


def _machine() -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if DEVICE.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def _rows(names: list[str], tiny: bool, ceilings: Ceilings) -> Iterator[dict[str, Any]]:
    for name in names:
        for case in SUITES[name](tiny):
            yield run_case(case, ceilings)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def pick_device(tiny: bool, needs_gpu: str) -> int | None:
    """Point DEVICE at this run's device: the GPU, or with ``tiny`` the CPU when there is none.
    An exit status when there is nothing to time: 0 without a GPU (saying ``needs_gpu``), 1 when
    Triton is interpreted (the interpreter would be timed); None to go on."""
    global DEVICE
    if tiny:
        DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return None
    if not torch.cuda.is_available():
        print(f"no CUDA device: {needs_gpu}; nothing to do")
        return 0
    if dispatch.interpreting():
        print("TRITON_INTERPRET=1 is set: unset it to time the compiled kernels", file=sys.stderr)
        return 1
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    suites = list(SUITES)
    p.add_argument("--only", nargs="+", choices=suites, help="suites to run (default: all)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results JSON (default: {DEFAULT_OUT})")
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes, any device (checks the script)"
    )
    args = p.parse_args(argv)
    needs_gpu = (
        "this benchmark needs a GPU (the kernels are tested on the CPU: pytest tests/kernels)"
    )
    if (status := pick_device(args.tiny, needs_gpu)) is not None:
        return status
    torch.manual_seed(0)
    machine = _machine()
    ceilings: dict[str, Any] = {"h200_datasheet": H200.as_json()}
    if (card := datasheet(machine["device"])) is not None:
        ceilings["card_datasheet"] = card.as_json()
    roof = card or H200  # on the CPU (--tiny) there is nothing to measure
    if DEVICE.type == "cuda":
        try:
            roof = measure_ceilings()
            ceilings["measured"] = roof.as_json()
        except Exception as exc:  # the kernels can still be checked and timed
            print(f"could not measure the ceilings ({exc}); using the datasheet's", flush=True)
    print(f"{machine['device']}: ceilings (GB/s, bf16 dense TFLOP/s) {ceilings}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "ferry.kernels.bench", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "ceilings": ceilings,
        "roofline_ceilings": next(
            k for k in ("measured", "card_datasheet", "h200_datasheet") if k in ceilings
        ),
        "shapes": "tiny" if args.tiny else "deepseek_v3 / deepseek_v4_flash",
        "complete": False,
        "results": [],
    }
    started = time.perf_counter()
    for row in _rows(args.only or suites, args.tiny, roof):
        result["results"].append(row)
        result["seconds"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(result, indent=2) + "\n")
        _print_row(row, roof)
    result["complete"] = True
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['seconds']} s)")
    return 0 if all(r["ok"] for r in result["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
