"""DeepSeek-V4's compressor emission: an entry is its window's rows pooled channel by channel,
each channel weighted by the softmax of its gate over the window's rows (CSA: 2 x 4 rows with the
overlap, HCA: 128). The norm and the rotation that follow stay in the model."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import register


@register("compress_pool", "torch")
def compress_pool_torch(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """kv, gate: [num_entries, rows, width] (gate already biased; -inf hides a row) ->
    [num_entries, width] in kv's dtype: Σ_r softmax_r(gate)[r] · kv[r], the softmax in float32,
    its weights in kv's dtype."""
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=1)
