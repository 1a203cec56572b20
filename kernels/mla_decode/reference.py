"""Absorbed MLA attention over the paged latent cache (the decode path)."""

from __future__ import annotations

import functools
import itertools
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


# A group of sequences costs about this many context tokens besides its tokens (its gather and
# two products are separate calls): ``length_groups`` weighs by it.
GROUP_COST_TOKENS = 256


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

    In a compiled graph of several sequences on the CPU this is one opaque op
    (``ferry::mla_decode_paged``), the same code as eagerly: inductor's own gather and products
    over the table's whole width were slower, the more so the more the lengths differ.
    Elsewhere a graph reads the whole width.
    """
    if torch.compiler.is_compiling():
        # (not the batch-1 graph, whose batch is the constant 1: there the graph's own fused
        # code is faster)
        one = isinstance(q.shape[0], int) and q.shape[0] == 1
        if q.device.type == "cpu" and not one:
            out: torch.Tensor = torch.ops.ferry.mla_decode_paged(
                q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank
            )
            return out
        # a captured graph reads the table's whole width: no host sync, no shape from the data
        batch, block_size = q.shape[0], kv_cache.shape[1]
        max_len = block_tables.shape[1] * block_size
        tables = block_tables.clamp(min=0).reshape(-1)
        kv = kv_cache[tables].view(batch, max_len, -1)
        return _attend(q, kv, seq_lens, max_len, softmax_scale, kv_lora_rank)
    return mla_decode_paged(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)


@torch.library.custom_op("ferry::mla_decode_paged", mutates_args=())
def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """``mla_decode_torch`` as eager code runs it, and as one opaque op for a compiled graph:
    the batch sorted by context length and attended in groups (``length_groups``), each group's
    context gathered up to its own longest, so a short sequence beside a long one does not pay
    for the long one's length."""
    groups = _length_groups(tuple(seq_lens.tolist()))
    if len(groups) == 1:
        return _attend_gathered(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for group in groups:
        idx = torch.tensor(group, device=q.device)
        out[idx] = _attend_gathered(
            q[idx], kv_cache, block_tables[idx], seq_lens[idx], softmax_scale, kv_lora_rank
        )
    return out


@mla_decode_paged.register_fake
def _(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)


def length_groups(lens: list[int]) -> list[list[int]]:
    """Indices of ``lens`` sorted by length, cut into the groups that minimise the sum over
    groups of ``GROUP_COST_TOKENS`` + members x longest."""
    return [list(group) for group in _length_groups(tuple(lens))]


# Every layer of a step asks with the same lengths: the dynamic programming (O(B^2) in the
# batch) runs once a step.
@functools.lru_cache(maxsize=4)
def _length_groups(lens: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    order = sorted(range(len(lens)), key=lens.__getitem__)
    n = len(order)
    best = [0] + [0x7FFFFFFF] * n  # best[j]: the cost of the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lens[order[j - 1]]
        for i in range(j):
            cost = best[i] + GROUP_COST_TOKENS + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(cut[bounds[-1]])
    bounds.reverse()
    return tuple(tuple(order[a:b]) for a, b in itertools.pairwise(bounds))


def _attend_gathered(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Every sequence's context up to the longest gathered into the reused buffer."""
    batch, block_size = q.shape[0], kv_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].clamp(min=0).reshape(-1)
    kv = _gather(kv_cache, tables).view(batch, num_blocks * block_size, -1)[:, :max_len]
    return _attend(q, kv, seq_lens, max_len, softmax_scale, kv_lora_rank)


def _attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """q [B, heads, dim] over kv [B, max_len, dim], each row up to its seq_len."""
    scores = torch.einsum("bhd,bld->bhl", q, kv).float() * softmax_scale
    pos = torch.arange(max_len, device=q.device)
    scores.masked_fill_(pos[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.einsum("bhl,bld->bhd", probs, kv[..., :kv_lora_rank])
