"""LeaseTable: the exporter pins a finished prefill's blocks until the importer releases them or
the lease expires. Pinned blocks stay in the prefix cache afterwards (they are only unreferenced)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ferry.services.engine.kv_cache import KvHolds
from ferry.services.kv_transfer import metrics

DEFAULT_LEASE_SECONDS = 30.0


@dataclass
class Lease:
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: float  # monotonic seconds


class LeaseTable:
    def __init__(
        self,
        kv: KvHolds,
        ttl: float = DEFAULT_LEASE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.ttl = ttl
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def create(
        self, block_ids: list[int], num_tokens: int, transfer_id: str | None = None
    ) -> Lease:
        """Pin ``block_ids`` (which a request holds now) under a new transfer id."""
        tid = transfer_id or uuid.uuid4().hex
        lease = Lease(tid, list(block_ids), num_tokens, self.clock() + self.ttl)
        with self._lock:
            self.kv.hold(f"lease:{tid}", lease.block_ids)
            self._leases[tid] = lease
        return lease

    def adopt(self, hold_key: str, num_tokens: int) -> Lease | None:
        """Turn the blocks held under ``hold_key`` (a prefill's hand-off) into a new lease;
        None when that hold is gone (the request was aborted meanwhile)."""
        tid = uuid.uuid4().hex
        with self._lock:
            blocks = self.kv.rename_hold(hold_key, f"lease:{tid}")
            if blocks is None:
                return None
            lease = Lease(tid, blocks, num_tokens, self.clock() + self.ttl)
            self._leases[tid] = lease
        return lease

    def get(self, transfer_id: str) -> Lease | None:
        """The live lease, or None (unknown, released or expired)."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is not None and lease.expires_at <= self.clock():
                self._drop(lease, expired=True)
                return None
            return lease

    def extend(self, transfer_id: str, seconds: float | None = None) -> bool:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.expires_at <= self.clock():
                return False
            lease.expires_at = self.clock() + (seconds or self.ttl)
            return True

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None:
                return False
            self._drop(lease, expired=False)
            return True

    def expire(self) -> int:
        """Free every expired lease; returns how many."""
        now = self.clock()
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in dead:
                self._drop(lease, expired=True)
        return len(dead)

    def __len__(self) -> int:
        return len(self._leases)

    def _drop(self, lease: Lease, expired: bool) -> None:
        del self._leases[lease.transfer_id]
        self.kv.release_hold(f"lease:{lease.transfer_id}")
        if expired:
            metrics.EXPIRED_LEASES.inc()
