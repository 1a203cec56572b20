"""What crosses between workers: the layout fingerprint, the KV handle, and transfer errors."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ferry.services.engine.model.cache_spec import CacheSpec, PagedGroup, StateRing

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class LayoutFingerprint:
    """What a cache's blocks hold, byte for byte: two caches exchange blocks only when every
    field matches. ``groups`` are the paged groups of every block (DeepSeek-V3: one latent
    group, an entry per token; V4: CSA entries, their indexer keys, HCA entries); ``state`` the
    rings of a request's state slot (V4's window and compressor rows), which a hand-off packs
    into ``state_blocks`` blocks after the prompt's."""

    model_fingerprint: str
    dtype: str
    block_size: int
    groups: tuple[PagedGroup, ...]
    state: tuple[StateRing, ...] = ()
    state_blocks: int = 0

    @classmethod
    def latent(
        cls, model_fingerprint: str, dtype: str, num_layers: int, latent_dim: int, block_size: int
    ) -> LayoutFingerprint:
        """A one-group cache, an entry per token: DeepSeek-V3's (kv_lora_rank + rope dims)."""
        return cls(
            model_fingerprint, dtype, block_size, (PagedGroup("latent", num_layers, 1, latent_dim),)
        )

    @classmethod
    def of(
        cls, model_fingerprint: str, dtype: str, block_size: int, spec: CacheSpec
    ) -> LayoutFingerprint:
        state_blocks = spec.state_blocks(block_size, _DTYPE_BYTES[dtype])
        return cls(model_fingerprint, dtype, block_size, spec.groups, spec.rings, state_blocks)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all groups and layers."""
        return sum(
            g.bytes_per_block(self.block_size, _DTYPE_BYTES[self.dtype]) for g in self.groups
        )

    @property
    def packed(self) -> bool:
        """Whether the cache keeps quantised rows (``--kv-cache-dtype fp8``)."""
        return any(g.packed for g in self.groups)

    @property
    def kinds(self) -> str:
        """The groups' and rings' names: what kind of model the cache is for."""
        names = [g.name for g in self.groups]
        return ", ".join(names + [f"state {r.name}" for r in self.state])

    def __str__(self) -> str:
        groups = " ".join(
            f"{g.name}[L{g.num_layers} /{g.tokens_per_entry} D{g.dim}{' bytes' if g.packed else ''}]"
            for g in self.groups
        )
        state = "".join(
            f" {r.name}[L{r.num_layers} R{r.rows} D{r.dim}{' ids' if r.token_ids else ''}]"
            for r in self.state
        )
        blocks = f" in {self.state_blocks} blocks" if self.state else ""
        return f"{self.model_fingerprint}/{self.dtype}/B{self.block_size} {groups}{state}{blocks}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayoutFingerprint:
        groups = tuple(PagedGroup(**g) for g in d["groups"])
        state = tuple(StateRing(**r) for r in d.get("state", ()))
        return cls(
            d["model_fingerprint"],
            d["dtype"],
            d["block_size"],
            groups,
            state,
            d.get("state_blocks", 0),
        )


@dataclass(frozen=True)
class KvHandle:
    """Handed out by the exporter for a finished prefill; names the blocks to pull."""

    transfer_id: str
    worker_id: str
    host: str
    port: int
    num_tokens: int
    block_size: int
    num_blocks: int  # the prompt's, then layout.state_blocks of its packed state
    layout: LayoutFingerprint
    expires_at: float  # wall-clock seconds (time.time())
    transport: str = "ucx"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KvHandle:
        d: dict[str, Any] = json.loads(text)
        d["layout"] = LayoutFingerprint.from_dict(d["layout"])
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
        why = ""
        if theirs.kinds != ours.kinds:  # e.g. a DeepSeek-V3 worker and a V4 one
            why = (
                f" (the exporter's cache holds {theirs.kinds}, this one {ours.kinds}: the two "
                f"workers serve different kinds of model)"
            )
        elif theirs.packed != ours.packed:
            fp8, other = ("the exporter's", "this worker's")[:: 1 if theirs.packed else -1]
            why = (
                f" ({fp8} cache is FP8 (--kv-cache-dtype fp8), {other} is not: start the "
                "prefill and decode workers with the same --kv-cache-dtype)"
            )
        super().__init__(
            "layout_mismatch",
            f"transfer {transfer_id}: the exporter's KV layout {theirs} does not match this "
            f"cache's {ours}; nothing was written{why}",
        )


class LeaseNotFound(TransferError):
    def __init__(self, transfer_id: str, peer: str) -> None:
        super().__init__(
            "not_found", f"transfer {transfer_id}: {peer} has no such lease (expired or released)"
        )
