"""Absorbed MLA attention over the paged latent cache (the decode path)."""

from __future__ import annotations

import threading

import torch

from ferry.kernels.dispatch import register

# NOTE: gathering the paged context into a fresh tensor every call costs ~8x the copy itself
# (a new multi-MB allocation faults in its pages); a per-thread buffer, grown as needed, avoids it.
_workspace = threading.local()


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """kv_cache[block_ids] into a reused buffer: [len(block_ids), block_size, dim]."""
    shape = (block_ids.numel(), *kv_cache.shape[1:])
    need = block_ids.numel() * kv_cache.shape[1] * kv_cache.shape[2]
    buf: torch.Tensor | None = getattr(_workspace, "buf", None)
    if (
        buf is None
        or buf.numel() < need
        or buf.dtype != kv_cache.dtype
        or buf.device != kv_cache.device
        # a buffer made under inference_mode cannot be written outside it (and the reverse
        # would keep autograd bookkeeping): one thread may run both, e.g. an Engine and a test
        or buf.is_inference() != torch.is_inference_mode_enabled()
    ):
        buf = torch.empty(need + need // 4, dtype=kv_cache.dtype, device=kv_cache.device)
        _workspace.buf = buf
    return torch.index_select(kv_cache, 0, block_ids, out=buf[:need].view(shape))


@register("mla_decode", "torch")
def mla_decode_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """One query per request attends to its whole paged context.

    q: [batch, heads, kv_lora_rank + rope_dim] (q_nope already multiplied by W_UK);
    kv_cache: [num_blocks, block_size, kv_lora_rank + rope_dim] for one layer;
    block_tables: [batch, max_blocks] int; seq_lens: [batch] int (tokens of context, >= 1).
    Returns [batch, heads, kv_lora_rank]: softmax(q·kᵀ·scale) · c_kv, W_UV not yet applied.
    NOTE: the cache is zero-initialised, so positions past seq_len read finite values and the
    masked softmax gives them weight 0 without NaNs.
    """
    batch = q.shape[0]
    block_size = kv_cache.shape[1]
    if torch.compiler.is_compiling():
        # a captured graph reads the table's whole width: no host sync, no shape from the data
        num_blocks = block_tables.shape[1]
        max_len = num_blocks * block_size
        tables = block_tables.clamp(min=0).reshape(-1)
        kv = kv_cache[tables].view(batch, max_len, -1)
    else:
        max_len = int(seq_lens.max())
        num_blocks = (max_len + block_size - 1) // block_size
        tables = block_tables[:, :num_blocks].clamp(min=0).reshape(-1)
        kv = _gather(kv_cache, tables).view(batch, num_blocks * block_size, -1)[:, :max_len]
    scores = torch.einsum("bhd,bld->bhl", q, kv).float() * softmax_scale
    pos = torch.arange(max_len, device=q.device)
    scores.masked_fill_(pos[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.einsum("bhl,bld->bhd", probs, kv[..., :kv_lora_rank])
