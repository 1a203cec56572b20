"""KV transfer between workers: handles, leases, and the ucx / local transports."""

from services.kv_transfer.endpoints import KvExporter, KvImporter
from services.kv_transfer.handle import (
    KvHandle,
    LayoutFingerprint,
    LayoutMismatch,
    LeaseNotFound,
    TransferError,
)
from services.kv_transfer.leases import LeaseTable
from services.kv_transfer.transport import TRANSPORTS, KvTransport, create_transport

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
