"""What a model keeps per token and per request, as groups: the engine budgets memory, sizes
blocks and admits requests from this alone, whichever model it runs. No torch.

- A *paged group* holds history that grows with the context, in the blocks of the request's one
  block table: one entry per ``tokens_per_entry`` tokens, on ``num_layers`` layers.
  DeepSeek-V3: one latent group (an entry per token). DeepSeek-V4: CSA entries and their indexer
  keys (an entry per ``csa_rate`` tokens), HCA entries (per ``hca_rate``).
- A *state ring* holds, per request, the last ``rows`` rows of something that only looks back a
  fixed distance: V4's sliding window and its compressors' not-yet-pooled rows. A request that
  runs holds one *state slot* (a row of every ring); it needs no blocks for these.
- A group or ring may be *packed*: its rows are bytes (values quantised with their scales, as
  DeepSeek-V4.1's FP8 cache keeps them), whatever the cache's dtype, and ``dim`` counts bytes.
- A *snapshot* is a copy of a slot's rings at a block boundary, kept for the prefix cache: a hit
  on the blocks before the boundary continues from it. Rings whose content at a block boundary
  is always empty (``at_boundary=False``: V4's HCA rows, as every rate divides the block) are
  left out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PACKED_ALIGN = 8  # a packed group's bytes in a block round up to this: the next one's aligned


@dataclass(frozen=True)
class PagedGroup:
    name: str
    num_layers: int
    tokens_per_entry: int
    dim: int  # values per entry (bytes, packed)
    packed: bool = False

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        if self.packed:
            size = self.num_layers * (block_size // self.tokens_per_entry) * self.dim
            return -(-size // PACKED_ALIGN) * PACKED_ALIGN
        return self.num_layers * (block_size // self.tokens_per_entry) * self.dim * itemsize

    def bytes_per_token(self, itemsize: int) -> float:
        return self.num_layers * self.dim * (1 if self.packed else itemsize) / self.tokens_per_entry


@dataclass(frozen=True)
class StateRing:
    name: str
    num_layers: int
    rows: int
    dim: int  # values per row (bytes, packed)
    at_boundary: bool = True  # holds anything at a block boundary (a snapshot copies it)
    token_ids: bool = False  # holds token ids: int64, whatever the cache's dtype
    packed: bool = False

    def bytes_per_slot(self, itemsize: int) -> int:
        size = 8 if self.token_ids else 1 if self.packed else itemsize
        return self.num_layers * self.rows * self.dim * size


@dataclass(frozen=True)
class CacheSpec:
    groups: tuple[PagedGroup, ...]
    rings: tuple[StateRing, ...] = ()
    default_block_size: int = 64

    @property
    def block_multiple(self) -> int:
        """A block holds whole entries of every group: its size is a multiple of this."""
        return math.lcm(*(g.tokens_per_entry for g in self.groups))

    def block_size(self, requested: int | None) -> int:
        """``requested``, checked; or the default rounded up to hold whole entries."""
        m = self.block_multiple
        if requested is None:
            return -(-self.default_block_size // m) * m
        if requested % m:
            ratios = sorted({g.tokens_per_entry for g in self.groups} - {1})
            raise ValueError(
                f"block_size={requested} does not hold whole compressed entries (the model "
                f"pools {', '.join(map(str, ratios))} tokens an entry): use a multiple of {m}"
            )
        return requested

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        return sum(g.bytes_per_block(block_size, itemsize) for g in self.groups)

    def bytes_per_state_slot(self, itemsize: int) -> int:
        return sum(r.bytes_per_slot(itemsize) for r in self.rings)

    def state_blocks(self, block_size: int, itemsize: int) -> int:
        """Blocks that hold one state slot's bytes: a prefill hands a request's state to its
        decode worker in these, beside the prompt's blocks (0 for a model without state)."""
        return -(-self.bytes_per_state_slot(itemsize) // self.bytes_per_block(block_size, itemsize))

    def bytes_per_snapshot(self, itemsize: int) -> int:
        return sum(r.bytes_per_slot(itemsize) for r in self.rings if r.at_boundary)

    def bytes_per_token(self, itemsize: int) -> float:
        """The paged part, per token of context."""
        return sum(g.bytes_per_token(itemsize) for g in self.groups)

    def describe(self, itemsize: int) -> list[dict[str, object]]:
        """One row per group and ring, for docs and benchmarks."""
        rows: list[dict[str, object]] = [
            {
                "group": g.name,
                "layers": g.num_layers,
                "tokens_per_entry": g.tokens_per_entry,
                "bytes_per_token": g.bytes_per_token(itemsize),
            }
            for g in self.groups
        ]
        rows += [
            {"ring": r.name, "layers": r.num_layers, "rows": r.rows, "bytes_per_request": b}
            for r in self.rings
            if (b := r.bytes_per_slot(itemsize))
        ]
        return rows
