"""DeepSeek-V4.1's golden cases (``tests/data/v41-golden``: tiny models with the outputs of
DeepSeek's reference code; see its README). ``case_dir`` expands a case's gzipped safetensors
once per test process into a temporary folder, removed when the process exits."""

from __future__ import annotations

import atexit
import functools
import gzip
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

DATA = Path(__file__).resolve().parent / "data" / "v41-golden"
CASES = ("mini-flash-fp8", "mini-flash-bf16", "compact-fp8")
PROMPTS = (0, 1, 2)


@functools.cache
def case_dir(case: str) -> Path:
    """A checkpoint folder for ``case``: config.json, tokenizer.json, model.safetensors and
    the goldens, as the reference wrote them."""
    out = Path(tempfile.mkdtemp(prefix=f"ferry-v41-{case}-"))
    atexit.register(shutil.rmtree, out, True)
    for f in (DATA / case).iterdir():
        if f.suffix == ".gz":
            with gzip.open(f) as src, (out / f.stem).open("wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(f, out / f.name)
    return out


@functools.cache
def goldens(case: str) -> dict[str, torch.Tensor]:
    return load_file(case_dir(case) / "goldens.safetensors")


def case_json(case: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / case / "case.json").read_text())
    return data


def config_json(case: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / case / "config.json").read_text())
    return data
