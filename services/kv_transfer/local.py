"""In-process transport: for tests and for a worker that is both prefill and decode."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ferry.services.kv_transfer.handle import LeaseNotFound
from ferry.services.kv_transfer.staging import checksum_blocks, gather_blocks
from ferry.services.kv_transfer.transport import KvSink, KvTransport, register

if TYPE_CHECKING:
    from ferry.services.kv_transfer.endpoints import KvExporter
    from ferry.services.kv_transfer.handle import KvHandle

_EXPORTERS: dict[int, KvExporter] = {}
_PORTS = itertools.count(1)


@register("local")
class LocalTransport(KvTransport):
    def __init__(self) -> None:
        self._ports: list[int] = []

    async def serve(self, exporter: KvExporter, host: str = "127.0.0.1", port: int = 0) -> int:
        port = port or next(_PORTS)
        _EXPORTERS[port] = exporter
        self._ports.append(port)
        return port

    def _exporter(self, handle: KvHandle) -> KvExporter:
        exporter = _EXPORTERS.get(handle.port)
        if exporter is None:
            raise LeaseNotFound(handle.transfer_id, f"local exporter {handle.port}")
        return exporter

    async def fetch(self, handle: KvHandle, sink: KvSink, want_checksum: bool) -> int | None:
        exporter = self._exporter(handle)
        lease = exporter.leases.get(handle.transfer_id)
        if lease is None:
            raise LeaseNotFound(handle.transfer_id, f"local exporter {handle.port}")
        gather_blocks(exporter.cache, lease.block_ids, out=sink.staged())  # sink scatters it
        return checksum_blocks(exporter.cache, lease.block_ids) if want_checksum else None

    async def release(self, handle: KvHandle) -> None:
        self._exporter(handle).leases.release(handle.transfer_id)

    async def extend(self, handle: KvHandle, seconds: float) -> bool:
        return self._exporter(handle).leases.extend(handle.transfer_id, seconds)

    async def close(self) -> None:
        for port in self._ports:
            _EXPORTERS.pop(port, None)
        self._ports.clear()
