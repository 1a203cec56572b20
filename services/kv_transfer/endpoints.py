"""Exporter and importer: transport-independent halves of a KV transfer."""

from __future__ import annotations

import asyncio
import time

import torch

from ferry.services.common.log import get_logger
from ferry.services.engine.kv_cache import KvHolds
from ferry.services.kv_transfer import metrics
from ferry.services.kv_transfer.handle import (
    KvHandle,
    LayoutFingerprint,
    LayoutMismatch,
    TransferError,
)
from ferry.services.kv_transfer.leases import DEFAULT_LEASE_SECONDS, Lease, LeaseTable
from ferry.services.kv_transfer.staging import StagingPool, checksum_blocks, gather_blocks
from ferry.services.kv_transfer.transport import KvSink, KvTransport

log = get_logger(__name__)


class KvExporter:
    """The prefill side: pins finished prefills under leases and stages their blocks on request."""

    def __init__(
        self,
        cache: torch.Tensor,
        kv: KvHolds,
        layout: LayoutFingerprint,
        worker_id: str,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        self.cache = cache
        self.kv = kv
        self.layout = layout
        self.worker_id = worker_id
        self.leases = LeaseTable(kv, lease_seconds)
        self.staging = StagingPool()

    def export(
        self, block_ids: list[int], num_tokens: int, host: str, port: int, transport: str
    ) -> KvHandle:
        """Lease ``block_ids`` (which a request holds now) and describe them for the importer."""
        return self._handle(self.leases.create(block_ids, num_tokens), host, port, transport)

    def export_hold(
        self, hold_key: str, num_tokens: int, host: str, port: int, transport: str
    ) -> KvHandle | None:
        """Lease the blocks held under ``hold_key`` (the engine's hand-off of a finished
        prefill); None when the hold is gone because the request was aborted."""
        lease = self.leases.adopt(hold_key, num_tokens)
        return None if lease is None else self._handle(lease, host, port, transport)

    def _handle(self, lease: Lease, host: str, port: int, transport: str) -> KvHandle:
        remaining = lease.expires_at - self.leases.clock()
        return KvHandle(
            transfer_id=lease.transfer_id,
            worker_id=self.worker_id,
            host=host,
            port=port,
            num_tokens=lease.num_tokens,
            block_size=self.layout.block_size,
            num_blocks=len(lease.block_ids),
            layout=self.layout,
            expires_at=time.time() + remaining,
            transport=transport,
        )

    async def run_reaper(self, interval: float = 1.0) -> None:
        """Free expired leases every ``interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.leases.expire()

    def open_send(self, transfer_id: str) -> Lease | None:
        """The live lease of ``transfer_id``, extended so that it cannot expire mid-send, or None."""
        lease = self.leases.get(transfer_id)
        if lease is None:
            return None
        self.leases.extend(transfer_id)
        return lease

    def take_staging(self, num_blocks: int) -> torch.Tensor:
        """An unfilled [layers, num_blocks, block_size, dim] buffer; give it back with :meth:`unstage`."""
        c = self.cache
        return self.staging.take((c.shape[0], num_blocks, c.shape[2], c.shape[3]), c.dtype)

    def stage(self, transfer_id: str) -> tuple[torch.Tensor, Lease] | None:
        """The lease's blocks gathered into one contiguous staging tensor (see :meth:`open_send`).
        Hand the tensor back with :meth:`unstage` once it is sent."""
        lease = self.open_send(transfer_id)
        if lease is None:
            return None
        buf = self.take_staging(len(lease.block_ids))
        return gather_blocks(self.cache, lease.block_ids, out=buf), lease

    def unstage(self, staged: torch.Tensor) -> None:
        self.staging.give(staged)


class KvImporter:
    """The decode side: reserves destination blocks, pulls, verifies, scatters. On any failure
    the destination blocks go back to the pool and a TransferError says which peer and transfer."""

    def __init__(
        self,
        transport: KvTransport,
        cache: torch.Tensor,
        kv: KvHolds,
        layout: LayoutFingerprint,
        transfer_timeout: float = 30.0,
        verify_checksum: bool = False,
    ) -> None:
        self.transport = transport
        self.cache = cache
        self.kv = kv
        self.layout = layout
        self.transfer_timeout = transfer_timeout
        self.verify_checksum = verify_checksum
        self.staging = StagingPool()

    @staticmethod
    def hold_key(handle: KvHandle) -> str:
        return f"import:{handle.transfer_id}"

    async def pull(self, handle: KvHandle, dst_block_ids: list[int] | None = None) -> list[int]:
        """Copy the handle's blocks into this cache. Without ``dst_block_ids`` the importer takes
        fresh blocks itself, held under :meth:`hold_key` until the caller adopts or releases them."""
        name = self.transport.name
        if handle.layout != self.layout:
            metrics.FAILED_TRANSFERS.labels(name, "layout_mismatch").inc()
            raise LayoutMismatch(self.layout, handle.layout, handle.transfer_id)
        key = self.hold_key(handle)
        if dst_block_ids is None:
            dst = self.kv.hold_new(key, handle.num_blocks)
            if dst is None:
                metrics.FAILED_TRANSFERS.labels(name, "no_blocks").inc()
                raise TransferError(
                    "no_blocks",
                    f"transfer {handle.transfer_id}: no room for {handle.num_blocks} blocks",
                )
        else:
            if len(dst_block_ids) != handle.num_blocks:
                raise ValueError(f"{len(dst_block_ids)} destination blocks for {handle.num_blocks}")
            dst = list(dst_block_ids)
        peer = f"{handle.worker_id}@{handle.host}:{handle.port}"
        sink = KvSink(self.cache, dst, self.staging)
        started = time.perf_counter()
        try:
            expect = await asyncio.wait_for(
                self.transport.fetch(handle, sink, self.verify_checksum), self.transfer_timeout
            )
            await sink.finish()
            if (
                self.verify_checksum
                and expect is not None
                and checksum_blocks(self.cache, dst) != expect
            ):
                raise TransferError(
                    "checksum", f"transfer {handle.transfer_id} from {peer}: checksum mismatch"
                )
        except BaseException as e:
            await sink.abandon()  # no copy may still be writing into blocks that go back
            if dst_block_ids is None:
                self.kv.release_hold(key)
            reason, err = _classify(e, handle, peer, self.transfer_timeout)
            metrics.FAILED_TRANSFERS.labels(name, reason).inc()
            if err is e:
                raise
            raise err from e
        nbytes = sink.nbytes
        metrics.TRANSFERS.labels(name).inc()
        metrics.TRANSFER_BYTES.labels(name).inc(nbytes)
        metrics.TRANSFER_SECONDS.labels(name).observe(time.perf_counter() - started)
        try:
            await asyncio.wait_for(self.transport.release(handle), self.transfer_timeout)
        except (
            Exception
        ) as e:  # the blocks are here: a lost release only leaves the lease to expire
            metrics.FAILED_RELEASES.labels(name).inc()
            log.warning(
                "kv_release_failed", transfer_id=handle.transfer_id, peer=peer, error=repr(e)
            )
        return dst


def _classify(
    e: BaseException, handle: KvHandle, peer: str, timeout: float
) -> tuple[str, BaseException]:
    if isinstance(e, TransferError):
        return e.reason, e
    if isinstance(e, TimeoutError):
        return "timeout", TransferError(
            "timeout", f"transfer {handle.transfer_id} from {peer}: no data within {timeout:.1f}s"
        )
    if isinstance(e, asyncio.CancelledError):
        return "cancelled", e
    return "peer_error", TransferError(
        "peer_error", f"transfer {handle.transfer_id} from {peer} failed: {e!r}"
    )
