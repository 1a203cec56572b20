"""The transport interface, its registry, and the sink a transport lands a pull in. The
exporter/importer around a transport own leases, layout checks and the cache's bookkeeping."""

from __future__ import annotations

import asyncio
import functools
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ferry.services.kv_transfer.registry import TRANSPORT_MODULES, transport_names
from ferry.services.kv_transfer.staging import (
    StagingPool,
    block_rows,
    chunk_ring,
    layer_block_bytes,
    row_order,
    scatter_layers,
    scatter_rows,
)

# After a failed in-place receive, the peer may still be finishing one message it had started
# writing into the blocks (a rendezvous put already granted): wait this long before the blocks
# can go back to the pool. One message is at most a layer's run, tens of ms at these rates.
IN_PLACE_GRACE_S = 0.5

if TYPE_CHECKING:
    from ferry.services.kv_transfer.endpoints import KvExporter
    from ferry.services.kv_transfer.handle import KvHandle


class KvSink:
    """Where one pull lands: the destination blocks of the importer's cache, in transfer order.

    A transport writes straight into runs of those blocks (:meth:`blocks`), or into
    :meth:`staged`, a contiguous [layers, blocks, block_size, dim] buffer, or a chunk of rows at a
    time into one of :meth:`chunk_buffers` (rows as in :mod:`~services.kv_transfer.staging`).
    For a staged receive it calls :meth:`landed` as layers complete, so that they are scattered
    into the cache while the rest arrives; a staged buffer that was never reported is scattered
    whole by :meth:`finish`. A chunk goes into the cache by :meth:`land_rows` before its buffer
    takes another.
    """

    def __init__(self, cache: torch.Tensor, block_ids: list[int], pool: StagingPool) -> None:
        self.cache = cache
        self.block_ids = block_ids
        self._pool = pool
        self._staged: torch.Tensor | None = None
        self._chunks: list[torch.Tensor] = []
        self._idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        self._copies: list[asyncio.Future[None]] = []
        self._in_place = False

    @property
    def nbytes(self) -> int:
        return self.cache.shape[0] * len(self.block_ids) * layer_block_bytes(self.cache)

    def blocks(self, layer: int, offset: int, n: int) -> torch.Tensor:
        """The cache view of blocks ``offset .. offset + n`` of the transfer in one layer; they
        must be consecutive block ids."""
        first = self.block_ids[offset]
        if self.block_ids[offset + n - 1] != first + n - 1:
            raise ValueError(f"blocks {offset}..{offset + n} of the transfer are not one run")
        self._in_place = True
        return self.cache[layer, first : first + n]

    def staged(self) -> torch.Tensor:
        if self._staged is None:
            c = self.cache
            shape = (c.shape[0], len(self.block_ids), c.shape[2], c.shape[3])
            self._staged = self._pool.take(shape, c.dtype)
        return self._staged

    @property
    def num_rows(self) -> int:
        return self.cache.shape[0] * len(self.block_ids)

    def chunk_buffers(self, per: int) -> list[torch.Tensor]:
        """Buffers to receive the transfer's rows ``per`` at a time (see
        :func:`~services.kv_transfer.staging.chunk_ring`)."""
        self._chunks = chunk_ring(self._pool, self.num_rows, per, layer_block_bytes(self.cache))
        return self._chunks

    def land_rows(self, r0: int, part: torch.Tensor) -> None:
        """Rows ``r0 .. r0 + len(part)`` of the transfer are in ``part``: copy them into the
        cache now (on this thread; a chunk takes a fraction of a millisecond)."""
        scatter_rows(self._rows, self._order[r0 : r0 + len(part)], part)

    @functools.cached_property
    def _rows(self) -> torch.Tensor:
        return block_rows(self.cache)

    @functools.cached_property
    def _order(self) -> np.ndarray:
        return row_order(self.block_ids, self.cache.shape[0], self.cache.shape[1])

    def landed(self, l0: int, l1: int) -> None:
        """Staged layers [l0, l1) are complete: copy them into the cache in the background."""
        loop = asyncio.get_running_loop()
        self._copies.append(
            loop.run_in_executor(None, scatter_layers, self.cache, self._idx, self.staged(), l0, l1)
        )

    async def finish(self) -> None:
        """Wait until every byte is in the cache, then hand the staging buffers back."""
        if self._staged is not None and not self._copies:
            self.landed(0, self.cache.shape[0])
        await asyncio.gather(*self._copies)
        if self._staged is not None:
            self._pool.give(self._staged)
            self._staged = None
        for buf in self._chunks:
            self._pool.give(buf)
        self._chunks = []

    async def abandon(self) -> None:
        """After a failure: wait for copies still writing into the blocks. The staging buffers
        are not reused, since a failed receive may still be writing into them."""
        await asyncio.gather(*self._copies, return_exceptions=True)
        if self._in_place:
            await asyncio.sleep(IN_PLACE_GRACE_S)


class KvTransport(ABC):
    name: ClassVar[str]
    # Fault injection for tests: the exporter pauses this long after the first bytes of a payload.
    fault_delay_before_payload_s: float = 0.0

    @abstractmethod
    async def serve(self, exporter: KvExporter, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start serving ``exporter``'s leases; returns the bound port."""

    @abstractmethod
    async def fetch(self, handle: KvHandle, sink: KvSink, want_checksum: bool) -> int | None:
        """Receive the blocks of ``handle`` into ``sink``; returns the exporter's checksum of
        them (:func:`~services.kv_transfer.staging.checksum_blocks`) when asked for. Raises
        TransferError."""

    @abstractmethod
    async def release(self, handle: KvHandle) -> None:
        """Tell the exporter the blocks arrived and the lease can go."""

    async def extend(self, handle: KvHandle, seconds: float) -> bool:
        """Ask the exporter to keep the lease ``seconds`` longer while we wait for room."""
        return False

    async def close(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Stop serving and drop pooled connections."""

    async def probe(self, timeout: float, host: str = "127.0.0.1") -> str | None:
        """None if this process can still open a new connection over this transport (to itself,
        at ``host``: an address of its own that its peers reach), else what went wrong. Only UCX can lose that ability for good (see ucx.UCX_DEFAULTS); the other
        transports have nothing to check."""
        return None


TRANSPORTS: dict[str, Callable[[], KvTransport]] = {}


def register(name: str) -> Callable[[type[KvTransport]], type[KvTransport]]:
    def wrap(cls: type[KvTransport]) -> type[KvTransport]:
        cls.name = name
        TRANSPORTS[name] = cls
        return cls

    return wrap


def create_transport(name: str) -> KvTransport:
    if name not in TRANSPORT_MODULES:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of {', '.join(transport_names())}"
        )
    importlib.import_module(TRANSPORT_MODULES[name])  # registers the transport's class
    return TRANSPORTS[name]()
