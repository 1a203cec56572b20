"""mla_decode on the CPU by the C kernel of ``paged_cpu.c``, which reads each request's blocks in
place instead of gathering them (see the source for how). Importing this module builds it
(:mod:`kernels.native`); a build that fails makes the dispatch point fall back to torch.

Float32 caches with heads a multiple of 8 take the kernel; anything else (bf16, odd head counts)
runs the torch reference, so the op's contract is ``mla_decode_torch``'s whatever the shapes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ferry.kernels import native
from ferry.kernels.dispatch import register
from ferry.kernels.mla_decode.reference import mla_decode_paged, mla_decode_torch

_fn = native.load(Path(__file__).with_name("paged_cpu.c")).ferry_mla_decode_f32
_fn.restype = ctypes.c_int
_fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]
NO_MEMORY, BAD_TABLE, UNSUPPORTED = -1, -2, -3


@register("mla_decode", "native")
def mla_decode_native(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """``mla_decode_torch``'s contract. In a compiled graph it is one opaque op, except in the
    batch-1 graph, where inductor's code for the torch reference is at least as fast."""
    if torch.compiler.is_compiling():
        if isinstance(q.shape[0], int) and q.shape[0] == 1:
            return mla_decode_torch(
                q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank
            )
        out: torch.Tensor = torch.ops.ferry.mla_decode_native(
            q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank
        )
        return out
    return _attend(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)


@torch.library.custom_op("ferry::mla_decode_native", mutates_args=())
def _op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    return _attend(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)


@_op.register_fake
def _(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)


def _attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    fits = (
        q.dtype == kv_cache.dtype == torch.float32
        and q.device.type == kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous()  # never copied: it is the whole layer's cache
    )
    if not fits or batch == 0:
        return mla_decode_paged(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = q.new_empty(batch, heads, kv_lora_rank)
    rc = _fn(
        q.data_ptr(),
        kv_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        dim,
        kv_lora_rank,
        kv_cache.shape[1],
        tables.shape[1],
        kv_cache.shape[0],
        softmax_scale,
    )
    if rc == UNSUPPORTED:
        return mla_decode_paged(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)
    if rc == BAD_TABLE:
        raise IndexError(
            f"mla_decode: a sequence length (1..{tables.shape[1] * kv_cache.shape[1]}) or a "
            f"block id (0..{kv_cache.shape[0] - 1}) is out of range"
        )
    if rc == NO_MEMORY:
        raise MemoryError("mla_decode: no memory for the kernel's workspace")
    return out
