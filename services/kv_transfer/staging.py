"""Blocks of a paged cache on the wire: staging buffers for fragmented blocks, and the plan that
lets a transport send from and receive into runs of contiguous blocks without any copy.

A transfer's bytes are always in the same order: layer by layer, and within a layer the blocks in
the lease's order. Either side copies only when its own blocks are too fragmented to send or
receive in place (see :class:`TransferPlan`); the checksum covers that order, so it does not
depend on which side staged. A row is one block of one layer: a transfer is ``layers x blocks``
rows in that order, and :func:`block_rows` views a cache as rows.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch

# A run of contiguous blocks is sent or received in place when a side's runs average at least
# this many bytes per layer. Below it the per-message cost (Python and UCX's handshake)
# outweighs a gather (`loadtest/results/kv_transfer.json`: in place against scattered).
DIRECT_MIN_RUN_BYTES = 1 << 20
# When both sides are fragmented, rows go in chunks of this size through WINDOW reused buffers
# on each side, so that a chunk is still in the CPU caches from the gather, through UCX's copy,
# to the scatter. 2 MB x 2: 5.4 GB/s on the small layout at 32k tokens, against 2.7 for one
# 20 MB layer at a time.
CHUNK_BYTES = 2 << 20
WINDOW = 2


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


def block_rows(cache: torch.Tensor) -> torch.Tensor:
    """cache: [layers, blocks, ...] -> [layers * blocks, row bytes] uint8, a view: row
    ``layer * blocks + b`` is block ``b`` of ``layer``. Raises if the cache cannot be viewed so."""
    return cache.view(torch.uint8).view(cache.shape[0] * cache.shape[1], -1)


def row_order(block_ids: list[int], num_layers: int, num_blocks: int) -> np.ndarray:
    """The :func:`block_rows` rows of a transfer of ``block_ids``, in transfer order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"block ids outside a cache of {num_blocks} blocks")
    return (np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks + ids).reshape(-1)


# NOTE: on the CPU these copy with numpy, a memcpy per row on the calling thread (15-17 GB/s).
# torch's index ops copy element by element on its intra-op pool (bf16 rows: 5 GB/s), and that
# pool's spinning workers take the core the UCX peer needs on a 2-core host.
def gather_rows(rows: torch.Tensor, order: np.ndarray, out: torch.Tensor) -> None:
    """out[i] = rows[order[i]], for ``order`` from :func:`row_order` (so in range)."""
    if rows.device.type == "cpu":
        np.take(rows.numpy(), order, axis=0, out=out.numpy(), mode="clip")  # clip: unbuffered
    else:
        torch.index_select(rows, 0, torch.from_numpy(order).to(rows.device), out=out)


def scatter_rows(rows: torch.Tensor, order: np.ndarray, part: torch.Tensor) -> None:
    """rows[order[i]] = part[i]."""
    if rows.device.type == "cpu":
        rows.numpy()[order] = part.numpy()
    else:
        rows.index_copy_(0, torch.from_numpy(order).to(rows.device), part)


def chunk_ring(pool: StagingPool, num_rows: int, per: int, row_bytes: int) -> list[torch.Tensor]:
    """[rows, row bytes] uint8 buffers to move ``num_rows`` rows ``per`` at a time: WINDOW of
    them, fewer when there are fewer chunks, none longer than the transfer."""
    chunks = -(-num_rows // per)
    shape = (min(per, num_rows), row_bytes)
    return [pool.take(shape, torch.uint8) for _ in range(min(WINDOW, chunks))]


def layer_chunks(
    num_layers: int, layer_bytes: int, target_bytes: int = 32 << 20
) -> list[tuple[int, int]]:
    """Split the layers into runs of about ``target_bytes``, so that copying one run overlaps
    with sending or receiving the next."""
    per = max(1, target_bytes // max(1, layer_bytes))
    return [(lo, min(lo + per, num_layers)) for lo in range(0, num_layers, per)]


def layer_block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block in one layer of a [layers, blocks, block_size, dim] cache."""
    return cache[0, 0].numel() * cache.element_size()


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each run of consecutive block ids, in transfer order."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


def runs_of(ranges: list[tuple[int, int]]) -> list[int]:
    """The block ids of (first_block, length) runs: the inverse of describing ids as runs."""
    return [b for first, n in ranges for b in range(first, first + n)]


def coarse(block_ids: list[int], layer_block_bytes: int) -> bool:
    """True when the ids' runs are long enough to move in place (see DIRECT_MIN_RUN_BYTES)."""
    if not block_ids:
        return False
    runs = len(block_runs(block_ids))
    return len(block_ids) * layer_block_bytes >= runs * DIRECT_MIN_RUN_BYTES


@dataclass(frozen=True)
class TransferPlan:
    """How one transfer is cut into messages when at least one side moves blocks in place.

    Each message is one layer x one piece; ``pieces`` are (offset, length) spans of the transfer's
    blocks, cut wherever a side that moves in place has a break in its block ids. A side that
    does not move in place stages the whole transfer and copies it layer by layer.
    """

    pieces: list[tuple[int, int]]
    src_in_place: bool
    dst_in_place: bool

    @classmethod
    def make(
        cls, src_ids: list[int], dst_ids: list[int], layer_block_bytes: int
    ) -> TransferPlan | None:
        """None when both sides are fragmented: then the transfer goes as staged layer chunks."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        src_in, dst_in = coarse(src_ids, layer_block_bytes), coarse(dst_ids, layer_block_bytes)
        if not (src_in or dst_in):
            return None
        cuts = {0, len(src_ids)}
        for ids, in_place in ((src_ids, src_in), (dst_ids, dst_in)):
            if in_place:
                cuts.update(off for off, _ in block_runs(ids))
        edges = sorted(cuts)
        return cls([(a, b - a) for a, b in itertools.pairwise(edges)], src_in, dst_in)

    def to_json(self) -> dict[str, object]:
        return {
            "pieces": self.pieces,
            "src_in_place": self.src_in_place,
            "dst_in_place": self.dst_in_place,
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> TransferPlan:
        pieces = [(int(a), int(b)) for a, b in d["pieces"]]  # type: ignore[attr-defined]
        return cls(pieces, bool(d["src_in_place"]), bool(d["dst_in_place"]))


def as_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


def checksum(t: torch.Tensor) -> int:
    return zlib.crc32(as_bytes(t))


def checksum_blocks(cache: torch.Tensor, block_ids: list[int]) -> int:
    """The checksum of the blocks in transfer order, without gathering them: equal to
    ``checksum(gather_blocks(cache, block_ids))``."""
    crc = 0
    runs = [(block_ids[off], n) for off, n in block_runs(block_ids)]
    for layer in cache:
        for first, n in runs:
            crc = zlib.crc32(as_bytes(layer[first : first + n]), crc)
    return crc


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

    def __len__(self) -> int:
        """Idle buffers held for reuse."""
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            idle = self._idle.setdefault((tuple(t.shape), t.dtype), [])
            if len(idle) < self.max_idle:
                idle.append(t)
