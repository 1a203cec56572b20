"""DeepSeek-V4's sparse attention: each query reads only the key rows its indices name (its
sliding window and, on CSA / HCA layers, the compressed entries it may see or the indexer chose),
every head the same rows (MQA, keys = values), with a learned sink logit per head that takes part
in the softmax but adds no value."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import register


@register("sparse_mqa", "torch")
def sparse_mqa_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """softmax([q·kv[i]·scale for i in indices[t] | sink]) without its sink column, times kv.

    q: [num_queries, heads, dim]; kv: [num_rows, dim], the pool every index points into;
    indices: [num_queries, k] int, -1 where a query has fewer than k rows (a query with none gets
    0: the sink takes the whole weight); sinks: [heads] float32. Returns [num_queries, heads, dim]
    in q's dtype. Scores in q's dtype, the softmax in float32, its weights in kv's dtype (as
    transformers' eager attention rounds).
    """
    valid = indices >= 0
    rows = kv[indices.clamp(min=0).long()]  # [T, k, dim]
    logits = torch.einsum("thd,tkd->thk", q, rows) * softmax_scale
    logits = logits.float().masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1].to(kv.dtype)
    return torch.einsum("thk,tkd->thd", probs, rows).to(q.dtype)
