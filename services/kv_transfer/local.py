"""In-process transport: for tests and for a worker that is both prefill and decode."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.kv_transfer.handle import LeaseNotFound
from services.kv_transfer.staging import checksum
from services.kv_transfer.transport import KvTransport, register

if TYPE_CHECKING:
    from services.kv_transfer.endpoints import KvExporter
    from services.kv_transfer.handle import KvHandle

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

    async def fetch(
        self,
        handle: KvHandle,
        into: torch.Tensor,
        want_checksum: bool,
        on_layers: Callable[[int, int], None] | None = None,
    ) -> int | None:
        staged = self._exporter(handle).stage(handle.transfer_id)
        if staged is None:
            raise LeaseNotFound(handle.transfer_id, f"local exporter {handle.port}")
        into.copy_(staged[0])
        crc = checksum(staged[0]) if want_checksum else None
        self._exporter(handle).unstage(staged[0])
        return crc

    async def release(self, handle: KvHandle) -> None:
        self._exporter(handle).leases.release(handle.transfer_id)

    async def extend(self, handle: KvHandle, seconds: float) -> bool:
        return self._exporter(handle).leases.extend(handle.transfer_id, seconds)

    async def close(self) -> None:
        for port in self._ports:
            _EXPORTERS.pop(port, None)
        self._ports.clear()
