"""KV transfer between workers: handles, leases, and the ucx / local transports."""

from ferry.services.kv_transfer.endpoints import KvExporter, KvImporter
from ferry.services.kv_transfer.handle import (
    KvHandle,
    LayoutFingerprint,
    LayoutMismatch,
    LeaseNotFound,
    TransferError,
)
from ferry.services.kv_transfer.leases import LeaseTable
from ferry.services.kv_transfer.transport import TRANSPORTS, KvTransport, create_transport

__all__ = [
    "TRANSPORTS",
    "KvExporter",
    "KvHandle",
    "KvImporter",
    "KvTransport",
    "LayoutFingerprint",
    "LayoutMismatch",
    "LeaseNotFound",
    "LeaseTable",
    "TransferError",
    "create_transport",
]
