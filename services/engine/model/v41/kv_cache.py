"""DeepSeek-V4.1's cache, by groups (see cache_spec.py for what a group and a ring are).

Paged, on the kv sources only (the other layers read their source's), one entry per ``ratio``
tokens: ``kv_r2`` / ``kv_r1`` (the compressed entries, rotated) and ``index_r2`` / ``index_r1``
(the indexer's keys). Rings, per request: ``swa`` (the window of every layer and DSpark stage,
rotated K = V rows), ``compressor_rows`` (a ratio-2 source's kv | score rows of its unfinished
pair, float32, empty at every even position, so at every block boundary) and ``engram_ids`` (Engram's
look-back: the compressed ids of the last tokens).

With ``--kv-cache-dtype fp8`` (``CacheFormat``) the window, the entries and the index keys are
packed rows of codes and scales (``quant.RowCodec``): V4.1-Flash's 3,200 bytes a token in bf16
become 890, its windows' 5.4 MiB a request 2.8.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferry.services.engine.model.cache_spec import CacheSpec, PagedGroup, StateRing
from ferry.services.engine.model.state_cache import StateCache
from ferry.services.engine.model.v41.config import V41ModelConfig
from ferry.services.engine.model.v41.layers import History
from ferry.services.engine.model.v41.quant import AUTO, CacheFormat, RowCodec


def _width(codec: RowCodec | None, n: int) -> tuple[int, bool]:
    """A group's or ring's row (dim, packed): n values, or the bytes of n packed."""
    return (n, False) if codec is None else (codec.row_bytes(n), True)


def v41_cache_spec(c: V41ModelConfig, fmt: CacheFormat = AUTO) -> CacheSpec:
    sources = {r: [s for s in c.kv_source_layer_ids if c.ratio(s) == r] for r in (2, 1)}
    kv, index = _width(fmt.entries, c.head_dim), _width(fmt.index, c.index_head_dim)
    groups = [PagedGroup(f"kv_r{r}", len(ids), r, *kv) for r, ids in sources.items()]
    groups += [PagedGroup(f"index_r{r}", len(ids), r, *index) for r, ids in sources.items()]
    layers = c.num_hidden_layers + c.num_nextn_predict_layers
    d = c.head_dim
    window, packed = _width(fmt.window, d)
    rings = [
        StateRing("swa", layers, c.sliding_window, window, packed=packed),
        # float32 whatever the cache's dtype, as the reference pools: bytes of a packed ring
        StateRing("compressor_rows", len(sources[2]), 2, 2 * d * 4, at_boundary=False, packed=True),
    ]
    if c.engram_layer_ids:
        lookback = c.engram_max_ngram_size - 1
        rings.append(StateRing("engram_ids", 1, lookback, 1, token_ids=True))
    return CacheSpec(
        groups=tuple(g for g in groups if g.num_layers),
        rings=tuple(r for r in rings if r.num_layers),
    )


class V41KVCache(StateCache):
    """The tensors of ``v41_cache_spec``; ``history`` gives one sequence's view of them."""

    def __init__(
        self,
        config: V41ModelConfig,
        fmt: CacheFormat,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_snapshots: int = 0,
    ) -> None:
        spec = v41_cache_spec(config, fmt)
        super().__init__(spec, num_blocks, block_size, num_slots, dtype, device, num_snapshots)
        self.config, self.format = config, fmt
        # each kv source's row in its ratio's groups, and a ratio-2 source's in the open rows
        self.source_row = {}
        for r in (2, 1):
            ids = [s for s in config.kv_source_layer_ids if config.ratio(s) == r]
            self.source_row.update({s: i for i, s in enumerate(ids)})

    def history(
        self,
        slot: int,
        block_ids: torch.Tensor,
        length: int,
        snapshots: Sequence[tuple[int, int]] = (),
    ) -> PagedHistory:
        return PagedHistory(self, slot, block_ids, length, snapshots)


class PagedHistory(History):
    """One sequence's history in the engine's cache: its compressed entries and index keys in
    its blocks (entry e of a ratio-r group in block ``block_ids[e // (block_size / r)]``), its
    windows, open rows and Engram look-back in its state slot, each row ``p`` at ``p % rows``.
    A slot's rows from an earlier request are never read: ``length`` says what is there.
    A snapshot is written where the chunk passes its position, into the snapshot's rings."""

    def __init__(
        self,
        cache: V41KVCache,
        slot: int,
        block_ids: torch.Tensor,
        length: int,
        snapshots: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.cache, self.slot, self.blocks, self.length = cache, slot, block_ids, length
        self.snapshots = snapshots
        self.config = cache.config
        self._added: dict[int, int] = {}  # entries this chunk wrote, per source
        # what a source's entries and keys read back as, until it adds more: its consumer
        # layers and index sources read the same rows (under FP8, each read decodes them all)
        self._reads: dict[tuple[str, int], torch.Tensor] = {}

    def _ring(self, name: str, layer: int) -> torch.Tensor:
        return self.cache.tensors[name][layer, self.slot]  # [rows, dim]

    def _store(self, codec: RowCodec | None, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.cache.dtype) if codec is None else codec.encode(rows)

    def _load(self, codec: RowCodec | None, stored: torch.Tensor, n: int) -> torch.Tensor:
        return stored if codec is None else codec.decode(stored, n, self.cache.dtype)

    def window(self, layer: int) -> torch.Tensor | None:
        if not self.length:
            return None
        ring = self._ring("swa", layer)
        w = ring.shape[0]
        positions = torch.arange(max(0, self.length - w), self.length)
        return self._load(self.cache.format.window, ring[positions % w], self.config.head_dim)

    def keep_window(self, layer: int, rows: torch.Tensor) -> None:
        # the rows end at the chunk's last token: positions end - len(rows) .. end - 1
        ring = self._ring("swa", layer)
        end = self.length + self._chunk_tokens
        positions = torch.arange(end - len(rows), end)
        ring[positions % ring.shape[0]] = self._store(self.cache.format.window, rows)

    def snapshot_window(self, layer: int, snapshot: int, position: int, rows: torch.Tensor) -> None:
        ring = self.cache.tensors["snap_swa"][layer, snapshot]
        positions = torch.arange(position - len(rows), position)
        ring[positions % ring.shape[0]] = self._store(self.cache.format.window, rows)

    def _group(self, kind: str, source: int) -> torch.Tensor:
        """The source's entries of group ``kind`` (kv / index) in every block: [blocks, per
        block, dim]."""
        r = self.config.ratio(source)
        return self.cache.tensors[f"{kind}_r{r}"][self.cache.source_row[source]]

    def _locate(self, source: int, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_block = self.cache.block_size // self.config.ratio(source)
        return self.blocks[entries // per_block], entries % per_block

    def _count(self, source: int) -> int:
        return self.length // self.config.ratio(source) + self._added.get(source, 0)

    def entries(self, source: int) -> torch.Tensor | None:
        return self._read("kv", source)

    def index_keys(self, source: int) -> torch.Tensor:
        return self._read("index", source)

    def _kind(self, kind: str) -> tuple[RowCodec | None, int]:
        fmt, c = self.cache.format, self.config
        return (fmt.entries, c.head_dim) if kind == "kv" else (fmt.index, c.index_head_dim)

    def _read(self, kind: str, source: int) -> torch.Tensor:
        if (kind, source) not in self._reads:
            block, at = self._locate(source, torch.arange(self._count(source)))
            codec, n = self._kind(kind)
            stored = self._group(kind, source)[block, at]
            self._reads[kind, source] = self._load(codec, stored, n)
        return self._reads[kind, source]

    def add_entries(self, source: int, entries: torch.Tensor, keys: torch.Tensor) -> None:
        n = self._count(source)
        block, at = self._locate(source, torch.arange(n, n + len(entries)))
        for kind, new in (("kv", entries), ("index", keys)):
            self._group(kind, source)[block, at] = self._store(self._kind(kind)[0], new)
        self._added[source] = self._added.get(source, 0) + len(entries)
        for kind in ("kv", "index"):
            self._reads.pop((kind, source), None)

    def open_rows(self, source: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        r = self.config.ratio(source)
        left = self.length % r
        if not left:
            return None
        ring = self._ring("compressor_rows", self.cache.source_row[source])
        rows = ring[torch.arange(self.length - left, self.length) % r].view(torch.float32)
        kv, score = rows.chunk(2, dim=-1)
        return kv, score

    def keep_open_rows(self, source: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        if not len(kv):
            return
        r = self.config.ratio(source)
        ring = self._ring("compressor_rows", self.cache.source_row[source])
        end = self.length + self._chunk_tokens
        positions = torch.arange(end - len(kv), end)
        ring[positions % r] = torch.cat([kv, score], dim=-1).float().view(torch.uint8)

    def engram_lookback(self) -> torch.Tensor | None:
        if not self.length:
            return None
        return self._ring("engram_ids", 0)[:, 0].clone()

    def keep_engram_lookback(self, ids: torch.Tensor) -> None:
        self._ring("engram_ids", 0)[:, 0] = ids

    def snapshot_engram_lookback(self, snapshot: int, ids: torch.Tensor) -> None:
        self.cache.tensors["snap_engram_ids"][0, snapshot, :, 0] = ids

    def end(self) -> None:
        super().end()
        self._added, self._reads = {}, {}
