"""How the dispatch point finds the Triton kernels: imported only when a call picks them, an
error that says what to do on CPU without the interpreter, and torch when Triton is broken.
Each case runs in a fresh interpreter, as Triton's settings are fixed once its kernels exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ferry.kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]
OPS = (
    "rms_norm",
    "add_rms_norm",
    "moe_route",
    "expert_counts",
    "fused_moe",
    "mla_decode",
    "prefill_attention",
    "sparse_mqa",
    "compress_pool",
    "indexer_topk",
)


def _python(
    code: str, pythonpath: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("FERRY_KERNELS", "TRITON_INTERPRET")}
    full.update(env)
    if pythonpath is not None:
        full["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{full.get('PYTHONPATH', '')}"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True
    )


def test_every_op_declares_a_triton_kernel() -> None:
    native = {"mla_decode"}  # the ops with a C kernel for the CPU too
    for op in OPS:
        want = ("torch", "triton", "native") if op in native else ("torch", "triton")
        assert dispatch.backends(op) == want, op


def test_triton_is_imported_only_when_a_kernel_is_picked() -> None:
    run = _python(
        "import sys, torch\n"
        "from ferry import kernels\n"
        "from ferry.kernels import dispatch\n"
        "x = torch.randn(3, 8)\n"
        "kernels.rms_norm(x, torch.ones(8), 1e-6)  # auto on CPU: torch\n"
        "assert 'triton' not in sys.modules\n"
        "fn = dispatch.resolve('rms_norm', torch.device('cuda'))  # auto on CUDA: Triton\n"
        "assert fn.__module__ == 'ferry.kernels.rmsnorm.triton_kernel', fn.__module__\n"
        "dispatch.set_backend('triton')\n"
        "kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
    )
    assert run.returncode != 0, run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError") and "set TRITON_INTERPRET=1" in last, run.stderr


def test_ferry_kernels_triton_runs_interpreted_on_cpu() -> None:
    run = _python(
        "import sys, torch\n"
        "from ferry import kernels\n"
        "x, w = torch.randn(3, 8), torch.rand(8)\n"
        "out = kernels.rms_norm(x, w, 1e-6)\n"
        "assert 'ferry.kernels.rmsnorm.triton_kernel' in sys.modules\n"
        "torch.testing.assert_close(out, kernels.rmsnorm.rms_norm_torch(x, w, 1e-6))\n",
        FERRY_KERNELS="triton",
        TRITON_INTERPRET="1",
    )
    assert run.returncode == 0, run.stderr


def test_broken_triton_falls_back_to_torch_under_auto(tmp_path: Path) -> None:
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('broken install')\n")
    run = _python(
        "import warnings, torch\n"
        "from ferry import kernels\n"
        "from ferry.kernels import dispatch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    fn = dispatch.resolve('rms_norm', torch.device('cuda'))\n"
        "    dispatch.resolve('rms_norm', torch.device('cuda'))\n"
        "assert fn is kernels.rmsnorm.rms_norm_torch\n"
        "assert len(caught) == 1 and 'broken install' in str(caught[0].message), caught\n"
        "dispatch.set_backend('triton')\n"
        "dispatch.resolve('rms_norm', torch.device('cuda'))\n",
        pythonpath=tmp_path,
    )
    assert run.returncode != 0, run.stdout
    assert "cannot import ferry.kernels.rmsnorm.triton_kernel (is Triton installed?)" in run.stderr
