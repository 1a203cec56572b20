"""DeepSeek-V4's lightning indexer: query t scores compressed entry s as
Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · dim^-0.5 in float32 and keeps its k best among the entries
it may see (a prefix of them: those its position has closed)."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import register


@register("indexer_topk", "torch")
def indexer_topk_torch(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, num_visible: torch.Tensor, k: int
) -> torch.Tensor:
    """q: [n, heads, dim]; weights: [n, heads] float32; keys: [entries, dim], shared by every
    query (a prefill chunk), or [n, entries, dim], each query's own (decode tokens);
    num_visible: [n] int, query t sees entries 0 .. num_visible[t] - 1. Returns [n, k] int64
    entry ids, best first, -1 where fewer than k are visible (k <= entries)."""
    if keys.dim() == 2:
        dots = torch.matmul(q.float(), keys.float().T)
    else:
        dots = torch.einsum("nhd,ned->nhe", q.float(), keys.float())
    scores = torch.relu(dots) * q.shape[-1] ** -0.5
    total = (scores * weights.float()[:, :, None]).sum(dim=1)  # [n, entries]
    entry = torch.arange(total.shape[1], device=q.device)
    visible = entry[None, :] < num_visible[:, None]
    total = total.masked_fill(~visible, float("-inf"))
    picks = total.topk(k, dim=-1).indices
    return torch.where(visible.gather(1, picks), picks, torch.full_like(picks, -1))
