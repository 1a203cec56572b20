"""Expanded attention for a chunk of new tokens over their full context (the prefill path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.dispatch import register


@register("prefill_attention", "torch")
def prefill_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Causal attention where the queries are the *last* ``q_len`` positions of the context.

    q: [heads, q_len, qk_dim]; k: [heads, ctx_len, qk_dim]; v: [heads, ctx_len, v_dim], with
    q_len <= ctx_len. Query i sits at position ctx_len - q_len + i. Returns [q_len, heads, v_dim].
    """
    q_len, ctx_len = q.shape[1], k.shape[1]
    v_dim = v.shape[-1]
    # NOTE: only 4-D inputs whose values are as wide as their keys reach torch's fused (flash)
    # CPU kernel; the rest fall back to the unfused math path, several times slower: padding
    # the values to the keys' width costs far less.
    if v_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - v_dim))
    q4, k4, v4 = q[None], k[None], v[None]
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=softmax_scale)
    elif q.device.type == "cpu":
        out = _prefix_then_causal(q4, k4, v4, ctx_len - q_len, softmax_scale)
    else:
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=softmax_scale)
    return out[0, ..., :v_dim].transpose(0, 1)


def _prefix_then_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, softmax_scale: float
) -> torch.Tensor:
    """A chunk after ``prefix`` cached positions, without a mask: the queries over the prefix
    (all of it visible), then over their own keys (causal, square), merged by each part's
    log-sum-exp. A boolean mask made the flash kernel compute the masked-out triangle and read
    the mask, which costs more than the second call."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    seen, seen_lse = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=softmax_scale)
    own, own_lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=softmax_scale)
    top = torch.maximum(seen_lse, own_lse)
    w_seen = torch.exp(seen_lse - top)[..., None]
    w_own = torch.exp(own_lse - top)[..., None]
    out = (seen.float() * w_seen + own.float() * w_own) / (w_seen + w_own)
    return out.to(q.dtype)
