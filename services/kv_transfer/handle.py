"""What crosses between workers: the layout fingerprint, the KV handle, and transfer errors."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayoutFingerprint:
    """Two caches can exchange blocks only when every field matches."""

    model_fingerprint: str
    dtype: str
    num_layers: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    block_size: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.num_layers * self.block_size * self.latent_dim * _DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.model_fingerprint}/{self.dtype}/L{self.num_layers}/D{self.latent_dim}/B{self.block_size}"


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KvHandle:
    """Handed out by the exporter for a finished prefill; names the blocks to pull."""

    transfer_id: str
    worker_id: str
    host: str
    port: int
    num_tokens: int
    block_size: int
    num_blocks: int
    layout: LayoutFingerprint
    expires_at: float  # wall-clock seconds (time.time())
    transport: str = "ucx"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KvHandle:
        d: dict[str, Any] = json.loads(text)
        d["layout"] = LayoutFingerprint(**d["layout"])
        return cls(**d)


class TransferError(RuntimeError):
    """A pull that failed; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class LayoutMismatch(TransferError):
    def __init__(
        self, ours: LayoutFingerprint, theirs: LayoutFingerprint, transfer_id: str
    ) -> None:
        super().__init__(
            "layout_mismatch",
            f"transfer {transfer_id}: the exporter's KV layout {theirs} does not match this "
            f"cache's {ours}; nothing was written",
        )


class LeaseNotFound(TransferError):
    def __init__(self, transfer_id: str, peer: str) -> None:
        super().__init__(
            "not_found", f"transfer {transfer_id}: {peer} has no such lease (expired or released)"
        )
