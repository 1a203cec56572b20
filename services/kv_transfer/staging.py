"""Blocks of a paged cache <-> one contiguous staging buffer (one message per transfer)."""

from __future__ import annotations

import threading
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


def gather_layers(
    cache: torch.Tensor, idx: torch.Tensor, staged: torch.Tensor, l0: int, l1: int
) -> None:
    """staged[l0:l1] = cache[l0:l1][:, idx] (one chunk of a pipelined send)."""
    torch.index_select(cache[l0:l1], 1, idx, out=staged[l0:l1])


def scatter_layers(
    cache: torch.Tensor, idx: torch.Tensor, staged: torch.Tensor, l0: int, l1: int
) -> None:
    """cache[l0:l1][:, idx] = staged[l0:l1] (one chunk of a pipelined receive)."""
    cache[l0:l1].index_copy_(1, idx, staged[l0:l1])


def layer_chunks(
    num_layers: int, layer_bytes: int, target_bytes: int = 32 << 20
) -> list[tuple[int, int]]:
    """Split the layers into runs of about ``target_bytes``, so that copying one run overlaps
    with sending or receiving the next."""
    per = max(1, target_bytes // max(1, layer_bytes))
    return [(lo, min(lo + per, num_layers)) for lo in range(0, num_layers, per)]


def as_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


def checksum(t: torch.Tensor) -> int:
    return zlib.crc32(as_bytes(t))


class StagingPool:
    """Reusable staging buffers by shape and dtype. A fresh multi-MB tensor per transfer spends
    more time faulting in its pages than the copy itself takes; a freed buffer is reused."""

    def __init__(self, max_idle_per_shape: int = 4) -> None:
        self.max_idle = max_idle_per_shape
        self._idle: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            idle = self._idle.get((shape, dtype))
            if idle:
                return idle.pop()
        return torch.empty(shape, dtype=dtype)

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            idle = self._idle.setdefault((tuple(t.shape), t.dtype), [])
            if len(idle) < self.max_idle:
                idle.append(t)
