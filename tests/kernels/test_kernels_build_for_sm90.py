"""Every Triton kernel compiles for an H200 (sm_90) at DeepSeek-V3's shapes, with its default
tiling, without spilling more than a few registers or asking for more shared memory than a
block may have. No GPU needed: Triton's
compiler runs on the CPU (see sm90_compile.py); in a fresh process, without the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = (
    "rms_norm",
    "moe_route",
    "expert_counts",
    "fused_moe gate_up",
    "fused_moe down",
    "fused_moe count",
    "fused_moe offsets",
    "fused_moe scatter",
    "fused_moe sum",
    "mla_decode split",
    "mla_decode merge",
    "prefill_attention",
    "sparse_mqa",
    "compress_pool CSA",
    "compress_pool HCA",
    "indexer_topk (shared keys)",
    "indexer_topk (per-query keys)",
)


def test_kernels_build_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, without its warning
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert all(name in run.stdout for name in KERNELS), run.stdout
