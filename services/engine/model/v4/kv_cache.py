"""DeepSeek-V4's cache tensors: three paged groups that share the request's block table, and
state rings indexed by the request's state slot (see cache_spec.py for the groups' roles).

Paged, one entry per ``rate`` tokens, in blocks of ``block_size // rate`` entries:
- ``csa_kv`` [CSA layers, blocks, entries, head_dim]: the CSA compressor's entries;
- ``csa_index`` [CSA layers, blocks, entries, index_head_dim]: the indexer's keys;
- ``hca_kv`` [HCA layers, blocks, entries, head_dim]: the HCA compressor's entries.
Rings, per state slot, a row per position ``p`` at ``p % rows``:
- ``swa`` [layers, slots, sliding_window, head_dim]: the rotated K = V rows of the window;
- ``csa_rows`` / ``index_rows`` [CSA layers, slots, 2 * csa_rate, 2 * width]: the projected
  kv | gate rows a CSA entry still needs (its window and, for the overlap, the one before);
- ``hca_rows`` [HCA layers, slots, hca_rate, 2 * head_dim]: the rows of the open HCA window.
Snapshots (``snap_<ring>``, [layers, snapshots, rows, dim]) copy a slot's rings at a block
boundary, but ``hca_rows``, empty there (the block size is a multiple of ``hca_rate``).

The paged groups live in one buffer, block-major: ``blocks`` [num_blocks, block bytes] uint8, a
block's bytes every group of every layer, and each group a strided view into it. So a block is
one run of bytes that a KV transport moves whole, and a state slot's rings, packed into spare
blocks (:meth:`V4KVCache.save_state`), travel to a decode worker beside the prompt's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.services.engine.model.cache_spec import CacheSpec, PagedGroup, StateRing
from ferry.services.engine.model.state_cache import StateCache
from ferry.services.engine.model.v4.config import CSA, HCA, V4ModelConfig


def v4_cache_spec(c: V4ModelConfig) -> CacheSpec:
    n_csa, n_hca = len(c.layer_ids(CSA)), len(c.layer_ids(HCA))
    d, di = c.head_dim, c.index_head_dim
    groups = [
        PagedGroup("csa_kv", n_csa, c.csa_rate, d),
        PagedGroup("csa_index", n_csa, c.csa_rate, di),
        PagedGroup("hca_kv", n_hca, c.hca_rate, d),
    ]
    rings = [
        StateRing("swa", c.num_hidden_layers, c.sliding_window, d),
        StateRing("csa_rows", n_csa, 2 * c.csa_rate, 4 * d),
        StateRing("index_rows", n_csa, 2 * c.csa_rate, 4 * di),
        StateRing("hca_rows", n_hca, c.hca_rate, 2 * d, at_boundary=False),
    ]
    return CacheSpec(
        groups=tuple(g for g in groups if g.num_layers),
        rings=tuple(r for r in rings if r.num_layers),
    )


@dataclass(frozen=True)
class CompressorCache:
    """One compressor's part of one layer: its paged entries and its ring of rows."""

    entries: torch.Tensor  # [blocks, entries per block, dim]
    rows: torch.Tensor  # [slots, ring rows, 2 * width]


# (entries group, ring, the layer's index in both) of a compressor or an indexer
_Part = tuple[str, str, int]


@dataclass(frozen=True)
class Ring:
    """One layer's part of a ring tensor, as the decode path writes it: ``rows`` is the whole
    tensor as [layers * slots * size, dim] rows, written by row number (a captured graph writes
    into its input in place; through a view of it, it would copy the whole tensor)."""

    rows: torch.Tensor
    layer: int
    num_slots: int
    size: int

    def row(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (self.layer * self.num_slots + slots) * self.size + positions % self.size

    def write(self, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Position ``positions[b]`` of slot ``slots[b]`` := ``values[b]``."""
        self.rows[self.row(slots, positions)] = values.to(self.rows.dtype)

    def read(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows of ``positions`` [B, n] of ``slots`` [B, 1]: [B, n, dim]."""
        return self.rows[self.row(slots, positions)]

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every row of ``slots`` [B], ring order: [B, size, dim]."""
        per_layer = self.num_slots * self.size
        view = self.rows[self.layer * per_layer : (self.layer + 1) * per_layer]
        return view.view(self.num_slots, self.size, -1)[slots]


@dataclass(frozen=True)
class Paged:
    """One layer's entries of a paged group in ``flat``, every block's elements in a row (the
    blocks buffer in the cache's dtype): entry e of block b starts at element
    ``b * block_elems + offset + e * dim``. Written by element, read through a view."""

    flat: torch.Tensor
    block_elems: int
    offset: int
    per_block: int
    dim: int

    @property
    def entries(self) -> torch.Tensor:
        """[blocks, per_block, dim], a view."""
        run = self.per_block * self.dim
        blocks = self.flat.view(-1, self.block_elems)[:, self.offset : self.offset + run]
        return blocks.view(-1, self.per_block, self.dim)

    def write(
        self, blocks: torch.Tensor, at: torch.Tensor, values: torch.Tensor, keep: torch.Tensor
    ) -> None:
        """Entry ``at[b]`` of block ``blocks[b]`` := ``values[b]`` where ``keep[b]``, else as
        it was (a graph writes every row: which ones count is data)."""
        values = torch.where(keep[:, None], values.to(self.flat.dtype), self.entries[blocks, at])
        first = blocks * self.block_elems + self.offset + at * self.dim
        self.flat[first[:, None] + torch.arange(self.dim, device=first.device)] = values

    def read(self, block_tables: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Entries ``entries`` [B, n] (ids >= 0) of each table [B, W] of blocks: [B, n, dim]."""
        index = block_tables.gather(1, entries // self.per_block)
        return self.entries[index, entries % self.per_block]


@dataclass(frozen=True)
class DecodeLayerCache:
    """One layer's cache as the decode path (and a graph of it) reads and writes it."""

    swa: Ring
    compressor: tuple[Paged, Ring] | None
    indexer: tuple[Paged, Ring] | None


@dataclass(frozen=True)
class LayerCache:
    swa: torch.Tensor  # [slots, sliding_window, head_dim]
    compressor: CompressorCache | None
    indexer: CompressorCache | None
    # (this layer's ring in slots, its snapshots) for each ring a snapshot copies
    snapshot_pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    decode: DecodeLayerCache | None = None

    def save(self, slot: int, snapshot: int) -> None:
        """Copy ``slot``'s rings of this layer into ``snapshot``."""
        for ring, snaps in self.snapshot_pairs:
            snaps[snapshot].copy_(ring[slot])


class V4KVCache(StateCache):
    def __init__(
        self,
        config: V4ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_snapshots: int = 0,
    ) -> None:
        spec = v4_cache_spec(config)
        super().__init__(spec, num_blocks, block_size, num_slots, dtype, device, num_snapshots)
        self.config = config
        self._csa = {layer: i for i, layer in enumerate(config.layer_ids(CSA))}
        self._hca = {layer: i for i, layer in enumerate(config.layer_ids(HCA))}
        # the views each layer reads, made once: the tensors never move
        decode = self.decode_layers(self.graph_inputs())
        self.layers = [self._layer(i, decode[i]) for i in range(config.num_hidden_layers)]

    def layer(self, layer_id: int) -> LayerCache:
        return self.layers[layer_id]

    def decode_layers(self, inputs: tuple[torch.Tensor, ...]) -> list[DecodeLayerCache]:
        """Every layer's ``DecodeLayerCache`` over ``inputs`` (``graph_inputs``' tensors, or a
        graph's inputs standing for them)."""
        flat, rings = inputs[0], dict(zip(self.rings, inputs[1:], strict=True))

        def ring(name: str, layer: int) -> Ring:
            return Ring(rings[name], layer, self.num_slots, self.tensors[name].shape[2])

        def paged(name: str, layer: int) -> Paged:
            _, _, per_block, dim = self.tensors[name].shape
            offset = self.group_offsets[name] + layer * per_block * dim
            return Paged(flat, self.block_elems, offset, per_block, dim)

        out = []
        for layer_id in range(self.config.num_hidden_layers):
            compressor, indexer = (
                None if part is None else (paged(part[0], part[2]), ring(part[1], part[2]))
                for part in self._parts(layer_id)
            )
            out.append(DecodeLayerCache(ring("swa", layer_id), compressor, indexer))
        return out

    def _parts(self, layer_id: int) -> tuple[_Part | None, _Part | None]:
        """Where ``layer_id``'s compressor and indexer keep their entries and rows."""
        if layer_id in self._csa:
            i = self._csa[layer_id]
            return ("csa_kv", "csa_rows", i), ("csa_index", "index_rows", i)
        if layer_id in self._hca:
            return ("hca_kv", "hca_rows", self._hca[layer_id]), None
        return None, None

    def _layer(self, layer_id: int, decode: DecodeLayerCache) -> LayerCache:
        t = self.tensors
        parts = self._parts(layer_id)
        compressor, indexer = (
            None if p is None else CompressorCache(t[p[0]][p[2]], t[p[1]][p[2]]) for p in parts
        )
        rings = [("swa", layer_id), *((p[1], p[2]) for p in parts if p is not None)]
        pairs = tuple((t[n][i], t["snap_" + n][i]) for n, i in rings if n in self.snapshot_rings)
        return LayerCache(t["swa"][layer_id], compressor, indexer, pairs, decode)
