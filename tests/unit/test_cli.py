from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from services.engine.model import load_model, prompt_logits


def _ferry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True
    )


def test_export_preset_small_sharded(tmp_path: Path) -> None:
    run = _ferry("export-preset", "small", str(tmp_path), "--max-shard-bytes", str(64 << 20))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert (tmp_path / "tokenizer.json").exists()
    ids = list(range(1, 200, 5))
    torch.testing.assert_close(
        prompt_logits(load_model(tmp_path), ids),
        prompt_logits(load_model("small"), ids),
        rtol=0,
        atol=0,
    )


def test_unknown_preset_is_a_usage_error(tmp_path: Path) -> None:
    run = _ferry("export-preset", "huge", str(tmp_path))
    assert run.returncode == 2 and "invalid choice: 'huge'" in run.stderr


def test_up_says_not_yet() -> None:
    run = _ferry("up")
    assert run.returncode == 2 and "not yet" in run.stderr
