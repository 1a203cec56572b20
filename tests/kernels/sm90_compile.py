"""Compile every Triton kernel for an H200 (sm_90) at DeepSeek-V3's shapes, on a machine without
a GPU: Triton's whole pipeline down to a cubin runs on the CPU, so a kernel that would not build
on the GPU (a bad static branch, dot shapes, shared memory) fails here. cuobjdump then reports each
kernel's registers and local memory (spills). Run as ``python -m tests.kernels.sm90_compile``; it must run
without TRITON_INTERPRET (interpreted kernels cannot be compiled)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ferry.kernels.fused_moe import triton_kernel as moe
from ferry.kernels.mla_decode import triton_kernel as mla
from ferry.kernels.mla_prefill import triton_kernel as prefill
from ferry.kernels.moe_routing import triton_kernel as routing
from ferry.kernels.rmsnorm import triton_kernel as rmsnorm

H200 = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232_448  # bytes of shared memory one block may use on sm_90
# The tilings measured fastest on an H100 (python -m kernels.tune) spill a few hundred bytes per
# thread here: mla_decode's 64 heads x 8 warps (2.3-2.5x faster than 16 heads, which did not
# spill) and fused_moe's 128-wide prefill tiles. More than this means a tiling to measure again.
MAX_LOCAL = 1024
_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
BF16, FP32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64


@dataclass(frozen=True)
class Build:
    name: str
    shared: int
    registers: int
    local: int  # bytes of local memory per thread: register spills and stack


def _source(kernel: Any, values: dict[str, Any]) -> ASTSource:
    """What Triton's launcher would compile for arguments like ``values``: a torch dtype stands
    for a (16-byte aligned) pointer to it, ints are i32 (i64 when larger; multiples of 16 marked
    so, as the launcher does), floats fp32; constexpr parameters take the value itself."""
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            sig[param.name], consts[param.name] = "constexpr", value
            continue
        if isinstance(value, torch.dtype):
            sig[param.name] = "*" + _TYPES[value]
        elif isinstance(value, int):
            sig[param.name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            sig[param.name] = "fp32"
        if isinstance(value, torch.dtype) or (isinstance(value, int) and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, sig, constexprs=consts, attrs=attrs)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, bytes of local memory: spills and stack) of a cubin's kernel."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        report = subprocess.run(
            [str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", report))
    return int(usage["REG"]), int(usage["STACK"]) + int(usage["LOCAL"])


def build(name: str, kernel: Any, num_warps: int = 4, num_stages: int = 3, **values: Any) -> Build:
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(_source(kernel, values), target=H200, options=options)
    registers, local = _resource_usage(compiled.asm["cubin"])
    return Build(name, compiled.metadata.shared, registers, local)


def deepseek_v3_builds() -> list[Build]:
    """Every kernel as the ops launch it for DeepSeek-V3 in bfloat16 (hidden 7168, 128 heads,
    kv_lora_rank 512, rope 64, 256 experts top-8 in 8 groups keeping 4, moe_intermediate 2048)."""
    hidden, inter, experts, top_k = 7168, 2048, 256, 8
    heads, rank, rope, block_size = 128, 512, 64, 64
    tokens = 4096
    choices = tokens * top_k
    out = [
        build(
            f"rms_norm(residual={res})",
            rmsnorm._rms_norm_kernel,
            num_warps=16,
            x_ptr=BF16,
            res_ptr=BF16,
            w_ptr=BF16,
            out_ptr=BF16,
            sum_ptr=BF16,
            n_cols=hidden,
            x_stride=hidden,
            res_stride=hidden,
            out_stride=hidden,
            sum_stride=hidden,
            eps=1e-6,
            HAS_RESIDUAL=res,
            BLOCK=8192,
        )
        for res in (False, True)
    ]
    out.append(
        build(
            "moe_route",
            routing._moe_route_kernel,
            logits_ptr=FP32,
            bias_ptr=FP32,
            weights_ptr=FP32,
            ids_ptr=I64,
            num_tokens=tokens,
            num_experts=experts,
            logits_stride=experts,
            routed_scaling_factor=2.5,
            HAS_BIAS=True,
            N_GROUP=8,
            TOPK_GROUP=4,
            TOP_K=top_k,
            RENORMALIZE=True,
            SCORING=0,
            BLOCK_T=routing.BLOCK_T,
            BLOCK_E=experts,
            BLOCK_G=8,
            BLOCK_K=top_k,
        )
    )
    out.append(
        build(
            "expert_counts",
            routing._expert_counts_kernel,
            ids_ptr=I64,
            counts_ptr=I32,
            n=choices,
            num_experts=experts,
            BLOCK=1024,
            BLOCK_E=experts,
        )
    )
    out += _fused_moe_builds(hidden, inter, experts, top_k, choices)
    dec = mla.DecodeBlocks()
    out.append(
        build(
            "mla_decode split",
            mla._split_kernel,
            num_warps=dec.num_warps,
            num_stages=dec.num_stages,
            q_ptr=BF16,
            kv_ptr=BF16,
            tables_ptr=I64,
            lens_ptr=I64,
            m_ptr=FP32,
            denom_ptr=FP32,
            acc_ptr=FP32,
            num_heads=heads,
            kv_lora_rank=rank,
            rope_dim=rope,
            block_size=block_size,
            scale_log2=0.2,
            q_stride_b=heads * (rank + rope),
            q_stride_h=rank + rope,
            kv_stride_block=block_size * (rank + rope),
            kv_stride_token=rank + rope,
            table_stride=512,
            NUM_SPLITS=8,
            BLOCK_H=dec.block_h,
            BLOCK_N=dec.block_n,
            BLOCK_R=rank,
            BLOCK_P=rope,
        )
    )
    out.append(
        build(
            "mla_decode merge",
            mla._merge_kernel,
            m_ptr=FP32,
            denom_ptr=FP32,
            acc_ptr=FP32,
            out_ptr=BF16,
            num_heads=heads,
            kv_lora_rank=rank,
            out_stride_b=heads * rank,
            out_stride_h=rank,
            NUM_SPLITS=8,
            BLOCK_S=8,
            BLOCK_R=rank,
        )
    )
    pre = prefill.PrefillBlocks()
    out.append(
        build(
            "prefill_attention",
            prefill._prefill_kernel,
            num_warps=pre.num_warps,
            num_stages=pre.num_stages,
            q_ptr=BF16,
            k_ptr=BF16,
            v_ptr=BF16,
            out_ptr=BF16,
            q_len=4096,
            ctx_len=4096,
            qk_dim=192,
            v_dim=128,
            scale_log2=0.2,
            q_stride_h=192,
            q_stride_t=heads * 192,
            k_stride_h=192,
            k_stride_t=heads * 192,
            v_stride_h=256,
            v_stride_t=heads * 256,
            out_stride_t=heads * 128,
            out_stride_h=128,
            BLOCK_M=pre.block_m,
            BLOCK_N=pre.block_n,
            BLOCK_D=256,
            BLOCK_DV=128,
        )
    )
    return out


def _fused_moe_builds(hidden: int, inter: int, experts: int, top_k: int, n: int) -> list[Build]:
    out = []
    for per_slot in (2, 32, 64, 128):  # decode to prefill: every tiling the default picks
        b = moe.MoEBlocks.default(per_slot * experts, experts)
        block_m = b.block_m
        common = dict(
            BLOCK_M=block_m,
            BLOCK_N=b.block_n,
            BLOCK_K=b.block_k,
            num_warps=b.num_warps,
            num_stages=b.num_stages,
        )
        out.append(
            build(
                f"fused_moe gate_up (block_m={block_m})",
                moe._gate_up_kernel,
                x_ptr=BF16,
                w13_ptr=BF16,
                act_ptr=BF16,
                sorted_ptr=I32,
                block_slot_ptr=I32,
                num_choices=n,
                hidden=hidden,
                inter=inter,
                x_stride=hidden,
                w_stride_s=2 * inter * hidden,
                w_stride_n=hidden,
                w_stride_k=1,
                act_stride=inter,
                swiglu_limit=10.0,
                TOP_K=top_k,
                HAS_LIMIT=False,
                **common,
            )
        )
        out.append(
            build(
                f"fused_moe down (block_m={block_m})",
                moe._down_kernel,
                act_ptr=BF16,
                w2_ptr=BF16,
                weights_ptr=FP32,
                y_ptr=BF16,
                sorted_ptr=I32,
                block_slot_ptr=I32,
                num_choices=n,
                hidden=hidden,
                inter=inter,
                act_stride=inter,
                w_stride_s=hidden * inter,
                w_stride_n=inter,
                w_stride_k=1,
                y_stride=hidden,
                **common,
            )
        )
    chunk = moe.MoEBlocks(block_m=16).chunk
    out.append(
        build(
            "fused_moe count",
            moe._count_kernel,
            slots_ptr=I64,
            counts_ptr=I32,
            num_choices=n,
            num_slots=experts,
            CHUNK=chunk,
            BLOCK_S=experts,
        )
    )
    out.append(
        build(
            "fused_moe offsets",
            moe._offsets_kernel,
            counts_ptr=I32,
            slot_start_ptr=I32,
            block_slot_ptr=I32,
            num_chunks=n // chunk,
            num_slots=experts,
            max_blocks=n // 16 + experts,
            BLOCK_M=16,
            BLOCK_S=experts,
            BLOCK_B=64,
        )
    )
    out.append(
        build(
            "fused_moe scatter",
            moe._scatter_kernel,
            slots_ptr=I64,
            counts_ptr=I32,
            slot_start_ptr=I32,
            sorted_ptr=I32,
            num_choices=n,
            num_slots=experts,
            CHUNK=chunk,
        )
    )
    out.append(
        build(
            "fused_moe sum",
            moe._sum_choices_kernel,
            y_ptr=BF16,
            slots_ptr=I64,
            out_ptr=BF16,
            hidden=hidden,
            y_stride=hidden,
            out_stride=hidden,
            TOP_K=top_k,
            BLOCK=1024,
        )
    )
    return out


def problems(builds: list[Build]) -> list[str]:
    """Kernels that would not launch (too much shared memory) or spill many registers."""
    out = [
        f"{b.name}: {b.shared} B of shared memory > {MAX_SHARED}"
        for b in builds
        if b.shared > MAX_SHARED
    ]
    return out + [
        f"{b.name}: {b.local} B of local memory (spills) > {MAX_LOCAL}"
        for b in builds
        if b.local > MAX_LOCAL
    ]


def main() -> int:
    from tests.kernels.sm90_compile_v4 import deepseek_v4_builds  # here: it imports this module

    builds = deepseek_v3_builds() + deepseek_v4_builds()
    for b in builds:
        print(f"{b.name:36s} shared {b.shared:7d} B  registers {b.registers:3d}  local {b.local} B")
    for problem in problems(builds):
        print(problem, file=sys.stderr)
    return 1 if problems(builds) else 0


if __name__ == "__main__":
    sys.exit(main())
