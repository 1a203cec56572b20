"""The transport interface and its registry. A transport moves one staged payload per transfer;
the exporter/importer around it own leases, layout checks and the cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from services.kv_transfer.endpoints import KvExporter
    from services.kv_transfer.handle import KvHandle


class KvTransport(ABC):
    name: ClassVar[str]
    # Fault injection for tests: the exporter pauses this long after the first bytes of a payload.
    fault_delay_before_payload_s: float = 0.0

    @abstractmethod
    async def serve(self, exporter: KvExporter, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start serving ``exporter``'s leases; returns the bound port."""

    @abstractmethod
    async def fetch(
        self,
        handle: KvHandle,
        into: torch.Tensor,
        want_checksum: bool,
        on_layers: Callable[[int, int], None] | None = None,
    ) -> int | None:
        """Receive the payload of ``handle`` into ``into`` ([layers, blocks, block_size, dim],
        contiguous, CPU); returns the exporter's checksum when asked for. A transport that
        receives layer by layer calls ``on_layers(l0, l1)`` as layers [l0, l1) land, for all of
        them, or never. Raises TransferError."""

    @abstractmethod
    async def release(self, handle: KvHandle) -> None:
        """Tell the exporter the blocks arrived and the lease can go."""

    async def extend(self, handle: KvHandle, seconds: float) -> bool:
        """Ask the exporter to keep the lease ``seconds`` longer while we wait for room."""
        return False

    async def close(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Stop serving and drop pooled connections."""


TRANSPORTS: dict[str, Callable[[], KvTransport]] = {}


def register(name: str) -> Callable[[type[KvTransport]], type[KvTransport]]:
    def wrap(cls: type[KvTransport]) -> type[KvTransport]:
        cls.name = name
        TRANSPORTS[name] = cls
        return cls

    return wrap


def create_transport(name: str) -> KvTransport:
    # Importing the modules registers the transports.
    from services.kv_transfer import grpc_transport, local, ucx  # noqa: F401

    if name not in TRANSPORTS:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of {', '.join(sorted(TRANSPORTS))}"
        )
    return TRANSPORTS[name]()
