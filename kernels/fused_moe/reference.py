"""Routed experts: SiLU-gated MLPs held in physical slots, applied to the tokens routed to them.
DeepSeek-V4 clamps the gate from above and the up projection both ways (``swiglu_limit``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.dispatch import register


@register("fused_moe", "torch")
def fused_moe_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_slots: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{slot[t, k]}(hidden[t]).

    hidden: [num_tokens, hidden]; w13: [num_slots, 2 * inter, hidden] (gate rows, then up rows);
    w2: [num_slots, hidden, inter]; topk_weights: [num_tokens, top_k] float32;
    topk_slots: [num_tokens, top_k] int64, a slot id per choice, or -1 for "not on this rank";
    a slot chosen twice for one token counts twice, each with its own weight.
    swiglu_limit: None, or L: silu(min(gate, L)) * clamp(up, -L, L).
    """
    if torch.compiler.is_compiling():
        return fused_moe_gathered(hidden, w13, w2, topk_weights, topk_slots, swiglu_limit)
    num_tokens, top_k = topk_slots.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    flat_slots = topk_slots.reshape(-1)
    order = torch.argsort(flat_slots, stable=True)
    counts = torch.bincount(flat_slots + 1, minlength=w13.shape[0] + 1)[1:]
    offsets = counts.cumsum(0) - counts
    skip = int((flat_slots < 0).sum())
    token_of = order // top_k  # token index of each sorted choice
    flat_weights = topk_weights.reshape(-1)
    for slot in torch.nonzero(counts).flatten().tolist():
        start = skip + int(offsets[slot])
        idx = order[start : start + int(counts[slot])]
        tokens = token_of[start : start + int(counts[slot])]
        gate, up = F.linear(hidden[tokens], w13[slot]).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, swiglu_limit), w2[slot])  # [n, hidden]
        out.index_add_(0, tokens, (y * flat_weights[idx, None]).to(out.dtype))
    return out


def fused_moe_gathered(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_slots: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """``fused_moe_torch`` for captured graphs: each token's chosen experts' weights are read
    where they lie (inductor fuses the gather into the products), no sort, no host sync, no
    shape that depends on the routing. It reads ``top_k`` experts per token, so it is for small
    batches: at batch 1 it reads exactly what the arithmetic needs."""
    valid = topk_slots >= 0
    slots = topk_slots.clamp(min=0)
    h = torch.einsum("tkoh,th->tko", w13[slots], hidden)  # [T, top_k, 2 * inter]
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("tkhi,tki->tkh", w2[slots], swiglu(gate, up, swiglu_limit))
    weights = torch.where(valid, topk_weights, 0.0)
    return (y * weights[..., None]).sum(dim=1).to(hidden.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up, with DeepSeek-V4's clamp when ``limit`` is set."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
