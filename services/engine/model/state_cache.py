"""The cache tensors of a model with paged groups and state rings (see cache_spec.py): one
layout for every family that has state (DeepSeek-V4, V4.1), each family adding the views its
layers read. A state slot's rings also travel to a decode worker, packed into spare blocks
(``save_state``), and a prefix-cache snapshot is a copy of them (``save`` / ``restore``)."""

from __future__ import annotations

import torch

from ferry.services.engine.model.cache_spec import CacheSpec


class StateCache:
    """A model's cache tensors laid out from its ``CacheSpec``: the paged groups in one buffer,
    block-major (``blocks`` [num_blocks, block bytes] uint8: a block's bytes of every group of
    every layer, each group a strided view ``tensors[name]`` [layers, blocks, entries, dim]), so
    that a block is one run of bytes a KV transport moves whole; the rings
    (``tensors[name]`` [layers, slots, rows, dim]) and their snapshots (``snap_<name>``, the
    rings a block boundary holds anything of). A family's cache adds the views its layers read."""

    def __init__(
        self,
        spec: CacheSpec,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_snapshots: int = 0,
    ) -> None:
        spec.block_size(block_size)  # whole entries per block, or a clear error
        self.block_size, self.num_slots = block_size, num_slots
        self.num_blocks = num_blocks
        self.dtype = dtype
        itemsize = dtype.itemsize
        self.blocks = torch.zeros(
            num_blocks, spec.bytes_per_block(block_size, itemsize), dtype=torch.uint8, device=device
        )
        self.tensors: dict[str, torch.Tensor] = {}
        # the blocks as elements of ``dtype``, and where each group's layer 0 starts in a block
        self.flat = self.blocks.view(dtype).view(-1)
        self.block_elems = self.blocks.shape[1] // itemsize
        self.group_offsets: dict[str, int] = {}
        at = 0
        for g in spec.groups:
            entries = block_size // g.tokens_per_entry
            size = g.bytes_per_block(block_size, itemsize)
            part = self.blocks[:, at : at + size]
            # a packed group's rows are bytes (the padding after them unused)
            part = part[:, : g.num_layers * entries * g.dim] if g.packed else part.view(dtype)
            self.tensors[g.name] = part.view(num_blocks, g.num_layers, entries, g.dim).transpose(
                0, 1
            )
            self.group_offsets[g.name] = at // itemsize
            at += size
        self.rings = [r.name for r in spec.rings]
        self.snapshot_rings = [r.name for r in spec.rings if r.at_boundary]
        for r in spec.rings:
            ring_dtype = torch.int64 if r.token_ids else torch.uint8 if r.packed else dtype
            shape = (r.num_layers, num_slots, r.rows, r.dim)
            self.tensors[r.name] = torch.zeros(shape, dtype=ring_dtype, device=device)
            if r.at_boundary:
                shape = (r.num_layers, num_snapshots, r.rows, r.dim)
                self.tensors["snap_" + r.name] = torch.zeros(shape, dtype=ring_dtype, device=device)

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

    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        """What a decode graph reads and writes: the blocks as elements (``flat``), then each
        ring (``rings``' order) as rows [layers * slots * rows, dim]."""
        rings = (self.tensors[n] for n in self.rings)
        return (self.flat, *(r.view(-1, r.shape[-1]) for r in rings))

    def save(self, slot: int, snapshot: int) -> None:
        """Copy ``slot``'s rings into ``snapshot``, every layer (``LayerCache.save``'s)."""
        for name in self.snapshot_rings:
            self.tensors["snap_" + name][:, snapshot].copy_(self.tensors[name][:, slot])

    def restore(self, snapshot: int, slot: int) -> None:
        """Continue ``slot`` from ``snapshot``: copy its rings back, every layer."""
        for name in self.snapshot_rings:
            self.tensors[name][:, slot].copy_(self.tensors["snap_" + name][:, snapshot])
