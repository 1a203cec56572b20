"""The whole model on each kernel backend: the model reaches every op through
``ferry.kernels.dispatch``, so forcing a backend runs its whole forward on those kernels.

    python loadtest/bench_model_kernels.py          # on a CUDA GPU -> loadtest/results/kernels_model.json
    TRITON_INTERPRET=1 python loadtest/bench_model_kernels.py --tiny   # tiny, on the CPU: checks it

Rows (the ``small`` preset; ``tiny`` with ``--tiny``): the float32 logits of one prompt on the
Triton kernels against the torch path within 1e-4, on both attention paths; then a bfloat16
decode step of 64 sequences at 2048 context and a prefill of 4 x 2048 tokens, timed on each
backend (``kernels.bench``'s timer). Without a CUDA device (and without ``--tiny``) it says so
and exits 0; the exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from harness import record, write_result

from ferry.kernels import bench
from ferry.services.engine.model import ForwardBatch, load_model, prompt_logits

DEFAULT_OUT = "loadtest/results/kernels_model.json"
MODEL_TOLERANCE = 1e-4


@functools.lru_cache(maxsize=2)
def _model(preset: str, dtype: torch.dtype) -> Any:
    return load_model(preset, dtype, bench.DEVICE)


def _on_backend(backend: str, fn: Callable[[], Any]) -> Any:
    bench.dispatch.set_backend(backend)
    try:
        return fn()
    finally:
        bench.dispatch.set_backend("auto")


def _model_logits_row(preset: str, attention: str, tokens: int) -> dict[str, Any]:
    """float32 logits of one prompt through the paged cache (blocks of 16): the prefill path
    ("expanded") or every position as a decode query over the cache ("absorbed")."""
    row: dict[str, Any] = {
        "op": "model_logits",
        "shape": {"preset": preset, "attention": attention, "tokens": tokens},
    }
    try:
        model = _model(preset, torch.float32)
        ids = torch.randint(0, model.config.vocab_size, (tokens,)).tolist()
        want = _on_backend("torch", lambda: prompt_logits(model, ids, 16, attention))  # type: ignore[arg-type]
        got = _on_backend("triton", lambda: prompt_logits(model, ids, 16, attention))  # type: ignore[arg-type]
        row["max_rel_err"] = bench.close(MODEL_TOLERANCE)(got, want)
        row["ok"] = True
    except Exception as exc:
        row |= bench.failure(exc)
    return row


def _model_step_row(preset: str, sequences: int, context: int, new_tokens: int) -> dict[str, Any]:
    """One bfloat16 forward of ``sequences`` requests, each adding ``new_tokens`` after
    ``context - new_tokens`` cached ones (1: a decode step), timed on each backend."""
    kind = "model_decode_step" if new_tokens == 1 else "model_prefill"
    row: dict[str, Any] = {
        "op": kind,
        "shape": {
            "preset": preset,
            "sequences": sequences,
            "context": context,
            "new_tokens": new_tokens,
        },
    }
    try:
        model = _model(preset, torch.bfloat16)
        block_size = 64
        per_seq = math.ceil(context / block_size)
        cache = model.allocate_kv_cache(sequences * per_seq, block_size)
        tables = torch.randperm(sequences * per_seq).view(sequences, per_seq).tolist()
        batch = ForwardBatch.build(
            [new_tokens] * sequences,
            [context - new_tokens] * sequences,
            tables,
            block_size,
            device=bench.DEVICE,
        )
        ids = torch.randint(
            0, model.config.vocab_size, (sequences * new_tokens,), device=bench.DEVICE
        )

        def forward() -> Any:
            with torch.inference_mode():
                return model(ids, batch, cache)

        row["torch_ms"] = _on_backend("torch", lambda: bench.time_ms(forward))
        row["triton_ms"] = _on_backend("triton", lambda: bench.time_ms(forward))
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["ok"] = True
    except Exception as exc:
        row |= bench.failure(exc)
    return row


def model_rows(tiny: bool) -> Iterator[dict[str, Any]]:
    preset = "tiny" if tiny else "small"
    for attention in ("expanded", "absorbed"):
        yield _model_logits_row(preset, attention, tokens=20 if tiny else 100)
    sequences, context = (2, 20) if tiny else (64, 2048)
    yield _model_step_row(preset, sequences, context, new_tokens=1)
    yield _model_step_row(preset, 1 if tiny else 4, context, new_tokens=context)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results JSON (default: {DEFAULT_OUT})")
    p.add_argument("--tiny", action="store_true", help="the tiny preset, any device")
    args = p.parse_args(argv)
    if (status := bench.pick_device(args.tiny, "this benchmark needs a GPU")) is not None:
        return status
    torch.manual_seed(0)
    result: dict[str, Any] = {**record(argv=argv), "device": str(bench.DEVICE), "results": []}
    started = time.perf_counter()
    for row in model_rows(args.tiny):
        result["results"].append(row)
        print(json.dumps(row), flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = write_result(args.out, result)
    print(f"wrote {out} ({result['seconds']} s)")
    return 0 if all(r["ok"] for r in result["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
