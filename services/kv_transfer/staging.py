"""Blocks of a paged cache <-> one contiguous staging buffer (one message per transfer)."""

from __future__ import annotations

import zlib

import torch


def gather_blocks(
    cache: torch.Tensor, block_ids: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """cache: [num_layers, num_blocks, block_size, dim] -> [num_layers, len(block_ids), block_size, dim]."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    if out is None:
        return torch.index_select(cache, 1, idx)
    return torch.index_select(cache, 1, idx, out=out)


def scatter_blocks(cache: torch.Tensor, block_ids: list[int], staged: torch.Tensor) -> None:
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    cache.index_copy_(1, idx, staged)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


def checksum(t: torch.Tensor) -> int:
    return zlib.crc32(as_bytes(t))
