"""The model runtime's entry points: ``load_model`` (a preset or a HF checkpoint directory),
``model_config`` (its config without the weights) and ``prompt_logits``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.forward_batch import AttentionPath, ForwardBatch
from ferry.services.engine.model.loader import (
    LoaderError,
    load_checkpoint,
    load_preset,
    read_config,
)
from ferry.services.engine.model.presets import PRESETS
from ferry.services.engine.model.registry import AnyModelConfig


def load_model(
    source: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
) -> MoECausalLM:
    """A preset name (``tiny``, ``small``, ``v4-tiny`` ...) or a HF checkpoint directory; the
    config says which model (DeepSeek-V3 or -V4)."""
    if isinstance(source, str) and source in PRESETS:
        return load_preset(source, dtype, device, placement)
    path = Path(source)
    if not path.is_dir():
        raise LoaderError(
            f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory"
        )
    return load_checkpoint(path, dtype, device, placement)


def model_config(source: str | Path) -> AnyModelConfig:
    """The ModelConfig of a preset or a checkpoint directory, without loading weights."""
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source].config
    return read_config(Path(source))


@torch.inference_mode()
def prompt_logits(
    model: MoECausalLM,
    token_ids: Sequence[int],
    block_size: int | None = None,
    attention: AttentionPath = "auto",
) -> torch.Tensor:
    """Logits for every position of one prompt, [len(token_ids), vocab_size] float32, through the
    paged cache path the engine uses (a private cache of just enough blocks)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("prompt_logits needs at least one token")
    vocab = model.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    block_size = model.cache_spec().block_size(block_size)  # None: the model's default
    num_blocks = (n + block_size - 1) // block_size
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    if model.attention_path != "auto":  # a model with one path (DeepSeek-V4)
        attention = model.attention_path
    cache = model.allocate_kv_cache(num_blocks, block_size, 1)
    batch = ForwardBatch.build(
        [n], [0], [list(range(num_blocks))], block_size, attention, model.device, [0]
    )
    return model.compute_logits(model(ids, batch, cache))
