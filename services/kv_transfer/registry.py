"""The KV transports by name, and the module that defines each. The names are known without
importing any transport (the CLI's choices); a transport's module, with UCX or torch, is imported
when one is created (``transport.create_transport``)."""

from __future__ import annotations

TRANSPORT_MODULES = {
    "grpc": "ferry.services.kv_transfer.grpc_transport",
    "local": "ferry.services.kv_transfer.local",
    "ucx": "ferry.services.kv_transfer.ucx",
}


def transport_names() -> list[str]:
    return sorted(TRANSPORT_MODULES)
