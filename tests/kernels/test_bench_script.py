"""kernels/bench.py and kernels/tune.py run only where a GPU is lent, so their every path is run
here first: their tiny shapes under Triton's interpreter, in a fresh process, down to the JSON
they leave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry.kernels.bench import SUITES
from ferry.kernels.tune import TILINGS, TINY_TILINGS

pytestmark = pytest.mark.slow  # ~40 s of benchmark scripts run tiny: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]


def _bench(
    tmp_path: Path, *args: str, interpret: bool = True, script: str = "ferry.kernels.bench"
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    how = [script] if script.endswith(".py") else ["-m", script]  # a loadtest script, a module
    return subprocess.run(
        [sys.executable, *how, "--out", str(tmp_path / "k.json"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tiny_run_checks_every_kernel(tmp_path: Path) -> None:
    run = _bench(tmp_path, "--tiny")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["complete"] and result["shapes"] == "tiny"
    rows = result["results"]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["op"] for r in rows} == set(SUITES) | {"add_rms_norm"}
    assert all(r["max_rel_err"] < 1e-2 and r["triton_ms"] > 0 for r in rows)
    assert f"wrote {tmp_path / 'k.json'}" in run.stdout


def test_tiny_model_run_checks_the_model_on_each_backend(tmp_path: Path) -> None:
    run = _bench(tmp_path, "--tiny", script=str(ROOT / "loadtest" / "bench_model_kernels.py"))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "k.json").read_text())["results"]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["op"] for r in rows} == {"model_logits", "model_decode_step", "model_prefill"}
    logits = [r for r in rows if r["op"] == "model_logits"]
    assert {r["shape"]["attention"] for r in logits} == {"expanded", "absorbed"}
    assert all(r["max_rel_err"] < 1e-4 for r in logits)


def test_cuda_graph_bench_runs_the_decode_step_on_the_gpus_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-graph benchmark's step on the CPU, on the Triton kernels a GPU runs (the
    interpreter): each batch's row, eager only (no graph to capture here)."""
    script = str(ROOT / "loadtest" / "bench_cuda_graphs.py")
    args = ("--device", "cpu", "--model", "tiny", "--batches", "1,2", "--context", "64")
    monkeypatch.setenv("FERRY_KERNELS", "triton")
    run = _bench(tmp_path, *args, "--steps", "1", script=script)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "k.json").read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert all(r["eager_ms"] > 0 and "graph_ms" not in r for r in result["rows"])
    assert result["one_user_tok_s"] == result["rows"][0]["tok_s_per_user"]
    assert result["seed_one_user_tok_s"] == 826.0


def test_tiny_tuning_checks_and_times_each_tiling(tmp_path: Path) -> None:
    run = _bench(tmp_path, "--tiny", script="ferry.kernels.tune")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["complete"]
    rows = result["results"]
    assert {r["op"] for r in rows} == set(TILINGS)
    for row in rows:  # the default, then the first candidates, each checked against the torch op
        tilings = row["tilings"]
        assert len(tilings) == 1 + TINY_TILINGS and tilings[0]["tiling"] == "default"
        assert all(t["ok"] and t["max_rel_err"] < 1e-2 and t["ms"] > 0 for t in tilings), row
        assert row["best_ms"] == min(t["ms"] for t in tilings)
        assert isinstance(tilings[1]["tiling"], dict) and "num_warps" in tilings[1]["tiling"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full run would start")
@pytest.mark.parametrize(
    "script",
    [
        "ferry.kernels.bench",
        "ferry.kernels.tune",
        str(ROOT / "loadtest" / "bench_model_kernels.py"),
        str(ROOT / "loadtest" / "bench_cuda_graphs.py"),
    ],
)
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path: Path, script: str) -> None:
    run = _bench(tmp_path, interpret=False, script=script)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no CUDA device" in run.stdout
    assert not (tmp_path / "k.json").exists()
