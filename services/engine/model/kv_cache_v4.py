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
from ferry.services.engine.model.config_v4 import CSA, HCA, V4ModelConfig


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


@dataclass(frozen=True)
class LayerCache:
    swa: torch.Tensor  # [slots, sliding_window, head_dim]
    compressor: CompressorCache | None
    indexer: CompressorCache | None
    # (this layer's ring in slots, its snapshots) for each ring a snapshot copies
    snapshot_pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def save(self, slot: int, snapshot: int) -> None:
        """Copy ``slot``'s rings of this layer into ``snapshot``."""
        for ring, snaps in self.snapshot_pairs:
            snaps[snapshot].copy_(ring[slot])


class V4KVCache:
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
        spec.block_size(block_size)  # whole entries per block, or a clear error
        self.config, self.block_size, self.num_slots = config, block_size, num_slots
        self.num_blocks = num_blocks
        itemsize = dtype.itemsize
        self.blocks = torch.zeros(
            num_blocks, spec.bytes_per_block(block_size, itemsize), dtype=torch.uint8, device=device
        )
        self.tensors: dict[str, torch.Tensor] = {}
        at = 0
        for g in spec.groups:
            entries = block_size // g.tokens_per_entry
            size = g.bytes_per_block(block_size, itemsize)
            part = self.blocks[:, at : at + size].view(dtype)
            self.tensors[g.name] = part.view(num_blocks, g.num_layers, entries, g.dim).transpose(
                0, 1
            )
            at += size
        self.rings = [r.name for r in spec.rings]
        self.snapshot_rings = [r.name for r in spec.rings if r.at_boundary]
        for r in spec.rings:
            shape = (r.num_layers, num_slots, r.rows, r.dim)
            self.tensors[r.name] = torch.zeros(shape, dtype=dtype, device=device)
            if r.at_boundary:
                shape = (r.num_layers, num_snapshots, r.rows, r.dim)
                self.tensors["snap_" + r.name] = torch.zeros(shape, dtype=dtype, device=device)
        self._csa = {layer: i for i, layer in enumerate(config.layer_ids(CSA))}
        self._hca = {layer: i for i, layer in enumerate(config.layer_ids(HCA))}
        # the views each layer reads, made once: the tensors never move
        self.layers = [self._layer(i) for i in range(config.num_hidden_layers)]

    @property
    def transfer(self) -> torch.Tensor:
        """The blocks as KV transports move them: [1, num_blocks, 1, block bytes] uint8."""
        return self.blocks[None, :, None, :]

    def save_state(self, slot: int, block_ids: list[int]) -> None:
        """Pack ``slot``'s rings into the blocks ``block_ids`` (``CacheSpec.state_blocks``)."""
        packed = torch.cat(
            [self.tensors[n][:, slot].reshape(-1).view(torch.uint8) for n in self.rings]
        )
        out = self.blocks.new_zeros(len(block_ids), self.blocks.shape[1])
        out.view(-1)[: packed.numel()] = packed
        self.blocks[torch.tensor(block_ids, device=self.blocks.device)] = out

    def load_state(self, block_ids: list[int], slot: int) -> None:
        """Unpack rings that :meth:`save_state` packed into ``block_ids`` into ``slot``."""
        packed = self.blocks[torch.tensor(block_ids, device=self.blocks.device)].view(-1)
        at = 0
        for name in self.rings:
            ring = self.tensors[name][:, slot]  # [layers, rows, dim]
            size = ring.numel() * ring.element_size()
            ring.copy_(packed[at : at + size].view(ring.dtype).view(ring.shape))
            at += size

    def layer(self, layer_id: int) -> LayerCache:
        return self.layers[layer_id]

    def _layer(self, layer_id: int) -> LayerCache:
        t = self.tensors
        index = {"swa": layer_id}
        compressor = indexer = None
        if layer_id in self._csa:
            i = index["csa_rows"] = index["index_rows"] = self._csa[layer_id]
            compressor = CompressorCache(t["csa_kv"][i], t["csa_rows"][i])
            indexer = CompressorCache(t["csa_index"][i], t["index_rows"][i])
        elif layer_id in self._hca:
            i = self._hca[layer_id]
            compressor = CompressorCache(t["hca_kv"][i], t["hca_rows"][i])
        pairs = tuple((t[n][i], t["snap_" + n][i]) for n, i in index.items())
        return LayerCache(t["swa"][layer_id], compressor, indexer, pairs)

    def restore(self, snapshot: int, slot: int) -> None:
        """Continue ``slot`` from ``snapshot``: copy its rings back, every layer."""
        for name in self.snapshot_rings:
            self.tensors[name][:, slot].copy_(self.tensors["snap_" + name][:, snapshot])
