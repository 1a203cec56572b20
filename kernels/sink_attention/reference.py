"""DeepSeek-V4's attention core: every head reads one shared key = value row set (MQA), and each
head has a learned sink logit that takes part in the softmax but contributes no value."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import register


@register("sink_attention", "torch")
def sink_attention_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    bias: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """softmax([q·kvᵀ·scale + bias | sink]) without its sink column, times kv.

    q: [num_queries, heads, dim]; kv: [num_keys, dim], the keys and the values alike, shared by
    every query (a prefill chunk), or [num_queries, num_keys, dim], each query's own (a batch of
    decode tokens); bias: [num_queries, num_keys] float, 0 where a query sees a key and -inf
    where not (a row may hide every key: then the sink takes the whole weight and the output is
    0); sinks: [heads] float32. Returns [num_queries, heads, dim] in q's dtype.
    """
    pattern = "thd,sd->ths" if kv.dim() == 2 else "thd,tsd->ths"
    logits = torch.einsum(pattern, q, kv) * softmax_scale + bias[:, None, :].to(q.dtype)
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat((logits.float(), sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1].to(kv.dtype)
    return torch.einsum("ths,sd->thd" if kv.dim() == 2 else "ths,tsd->thd", probs, kv)
