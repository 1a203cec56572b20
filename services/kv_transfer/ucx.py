"""UCX transport over ucxx: a listener on the exporter, pooled async endpoints on the importer.

Per transfer, on one endpoint: the importer sends a JSON request, the exporter answers with a
JSON header saying how the payload is cut, then sends it message by message (rendezvous
protocol: UCX copies each straight from the exporter's buffer into the importer's). When both
sides' blocks are fragmented the payload goes in chunks of rows, chunk i tagged i, through a few
reused buffers on each side: the exporter gathers the next chunk while earlier ones are on the
wire, the importer scatters each as it lands. Otherwise
(:class:`~services.kv_transfer.staging.TransferPlan`) runs of blocks go in place, and a
fragmented side stages the whole transfer, layer by layer. CPU buffers go over TCP or shared
memory here; a CUDA tensor would go the same way without a host copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferry.services.common.log import get_logger
from ferry.services.kv_transfer.handle import LeaseNotFound, TransferError
from ferry.services.kv_transfer.staging import (
    CHUNK_BYTES,
    TransferPlan,
    block_rows,
    block_runs,
    checksum_blocks,
    chunk_ring,
    gather_layers,
    gather_rows,
    layer_block_bytes,
    layer_chunks,
    row_order,
    runs_of,
)
from ferry.services.kv_transfer.transport import KvSink, KvTransport, register

if TYPE_CHECKING:
    from ferry.services.kv_transfer.endpoints import KvExporter
    from ferry.services.kv_transfer.handle import KvHandle

log = get_logger(__name__)

# UCX reads its configuration from the environment once, when ucxx is imported. Each default
# below applies only when unset; the measurements behind them are in docs/ucx.md.
# - polling progress: ~2.3x ucxx's progress thread here, and unlike its `blocking` mode it
#   cannot livelock the event loop (a connect that never completes fails after its timeout);
# - shared memory with peer-failure handling, so that posix/sysv and cma carry transfers on one
#   host (~9x tcp on loopback). The price: a peer SIGKILLed mid-transfer can leave this process
#   unable to connect to new peers (workers probe for it, --kv-probe-interval, and restart);
#   UCX_MM_ERROR_HANDLING=n trades the bandwidth for safety;
# - the rendezvous scheme is UCX's (get_zcopy over cma on one host: 2.4x put_zcopy);
# - no warning about the variables ucxx itself sets.
UCX_DEFAULTS = {
    "UCXPY_PROGRESS_MODE": "polling",
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
# Services: the progress thread with Python futures, or every idle pooled endpoint polls the
# event loop and an idle worker spins a core. Futures bind ucxx to one event loop: services only.
UCX_SERVICE_DEFAULTS = {"UCXPY_PROGRESS_MODE": "thread", "UCXPY_ENABLE_PYTHON_FUTURE": "1"}
CLOSE_WAIT_S = 2.0  # how long close() waits for the listener's handlers to end
WEDGED_HINT = (
    "if connects to every peer time out, a peer killed mid-transfer may have wedged this "
    "process's UCX shared memory: restart it (UCX_MM_ERROR_HANDLING=n avoids this; workers "
    "notice it themselves with --kv-probe-interval)"
)


def use_service_defaults() -> None:
    """Call before the first UCX use in a service process (one event loop, pooled endpoints)."""
    for k, v in UCX_SERVICE_DEFAULTS.items():
        os.environ.setdefault(k, v)


def stop_service_threads() -> None:
    """Call when a service has closed its UCX transports: ucxx's notifier thread (futures mode)
    is not a daemon and would otherwise keep the process from exiting."""
    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()


def _ucxx() -> Any:
    for k, v in UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import ucxx

    return ucxx


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).reshape(-1).numpy()


async def _send_json(ep: Any, msg: dict[str, Any]) -> None:
    await ep.send_obj(json.dumps(msg).encode())


async def _recv_json(ep: Any) -> dict[str, Any]:
    msg: dict[str, Any] = json.loads(bytes(await ep.recv_obj()))
    return msg


async def _receive(ep: Any, sink: KvSink, header: dict[str, Any]) -> None:
    """Receive the messages the exporter's header announced, in the exporter's order."""
    if "rows_per_chunk" in header:  # both sides fragmented
        await _receive_rows(ep, sink, int(header["rows_per_chunk"]))
        return
    plan = TransferPlan.from_json(header["plan"])
    for layer in range(sink.cache.shape[0]):
        for off, n in plan.pieces:
            if plan.dst_in_place:
                part = sink.blocks(layer, off, n)
            else:
                part = sink.staged()[layer, off : off + n]
            await ep.recv(_bytes_view(part))
        if not plan.dst_in_place:
            sink.landed(layer, layer + 1)


async def _receive_rows(ep: Any, sink: KvSink, per: int) -> None:
    """The chunks of :func:`_send_rows`, a receive posted ahead for each buffer, each chunk
    scattered into the cache as it lands."""
    starts = range(0, sink.num_rows, per)
    ring = sink.chunk_buffers(per)
    recvs: dict[int, asyncio.Future[Any]] = {}

    def post(i: int) -> None:
        if i < len(starts):
            part = ring[i % len(ring)][: sink.num_rows - starts[i]]
            recvs[i] = asyncio.ensure_future(ep.recv(_bytes_view(part), tag=i))

    for i in range(len(ring)):
        post(i)
    try:
        for i, r0 in enumerate(starts):
            await recvs.pop(i)
            sink.land_rows(r0, ring[i % len(ring)][: sink.num_rows - r0])
            post(i + len(ring))
    except BaseException:
        await _drop(list(recvs.values()))
        raise


async def _send_rows(exporter: KvExporter, ep: Any, src: list[int], per: int) -> None:
    """The transfer's rows in chunks of ``per``, chunk i tagged i, through a ring of buffers:
    the next chunk is gathered (on this thread, a fraction of a millisecond) while earlier ones
    are on the wire."""
    cache = exporter.cache
    rows = block_rows(cache)
    order = row_order(src, cache.shape[0], cache.shape[1])
    ring = chunk_ring(exporter.staging, len(order), per, rows.shape[1])
    sends: list[asyncio.Future[Any]] = []
    try:
        for i, r0 in enumerate(range(0, len(order), per)):
            if i >= len(ring):
                await sends[i - len(ring)]  # its buffer is free again
            part = ring[i % len(ring)][: len(order) - r0]
            gather_rows(rows, order[r0 : r0 + per], part)
            sends.append(asyncio.ensure_future(ep.send(_bytes_view(part), tag=i)))
        await asyncio.gather(*sends)
    except BaseException:
        await _drop(sends)
        raise
    for buf in ring:  # only after every send completed: a failed one may still read it
        exporter.unstage(buf)


async def _drop(requests: list[asyncio.Future[Any]]) -> None:
    """Cancel the requests of a failed transfer and wait until they have ended."""
    for r in requests:
        r.cancel()
    await asyncio.gather(*requests, return_exceptions=True)


async def _send_planned(exporter: KvExporter, ep: Any, src: list[int], plan: TransferPlan) -> None:
    """One message per layer and piece of ``plan``: from the cache where the exporter's blocks
    are in place, else out of a staging buffer gathered in layer chunks, chunk i+1 while chunk i
    is sent."""
    cache = exporter.cache
    num_layers = cache.shape[0]
    chunks = layer_chunks(num_layers, len(src) * layer_block_bytes(cache))
    staged = None if plan.src_in_place else exporter.take_staging(len(src))
    loop = asyncio.get_running_loop()
    idx = torch.tensor(src, dtype=torch.long, device=cache.device)

    def gather(i: int) -> asyncio.Future[None] | None:
        if staged is None or i >= len(chunks):
            return None
        return loop.run_in_executor(None, gather_layers, cache, idx, staged, *chunks[i])

    pending = gather(0)
    for i, (l0, l1) in enumerate(chunks):
        if pending is not None:
            await pending
            pending = gather(i + 1)
        for layer in range(l0, l1):
            for off, n in plan.pieces:
                if staged is None:  # in place: the run straight out of the cache
                    part = cache[layer, src[off] : src[off] + n]
                else:
                    part = staged[layer, off : off + n]
                await ep.send(_bytes_view(part))
    if staged is not None:
        exporter.unstage(staged)  # only after every send completed: a failed one may still read it


@register("ucx")
class UcxTransport(KvTransport):
    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._listener: Any = None
        self._idle: dict[tuple[str, int], list[Any]] = defaultdict(list)
        self._served: set[Any] = set()  # importers' endpoints the listener is answering

    # ---- exporter -------------------------------------------------------------------------
    async def serve(self, exporter: KvExporter, host: str = "127.0.0.1", port: int = 0) -> int:
        ucxx = _ucxx()

        async def handler(ep: Any) -> None:
            self._served.add(ep)
            try:
                with contextlib.suppress(Exception):  # the peer went away: nothing to answer
                    while True:
                        await self._answer(exporter, ep, await _recv_json(ep))
            finally:
                self._served.discard(ep)

        self._listener = ucxx.create_listener(handler, port=port or None)
        return int(self._listener.port)

    async def _answer(self, exporter: KvExporter, ep: Any, msg: dict[str, Any]) -> None:
        op, tid = msg.get("op"), msg.get("transfer_id", "")
        if op == "pull":
            await self._send_payload(exporter, ep, msg)
        elif op == "release":
            await _send_json(ep, {"ok": exporter.leases.release(tid)})
        elif op == "extend":
            await _send_json(ep, {"ok": exporter.leases.extend(tid, msg.get("seconds"))})
        else:
            await _send_json(ep, {"ok": False, "reason": f"unknown op {op!r}"})

    async def _send_payload(self, exporter: KvExporter, ep: Any, msg: dict[str, Any]) -> None:
        lease = exporter.open_send(msg["transfer_id"])
        if lease is None:
            await _send_json(ep, {"ok": False, "reason": "not_found"})
            return
        cache, src = exporter.cache, lease.block_ids
        dst = runs_of(msg["dst_runs"])
        if len(dst) != len(src):
            reason = f"{len(src)} blocks leased, {len(dst)} destination blocks asked for"
            await _send_json(ep, {"ok": False, "reason": reason})
            return
        block_bytes = layer_block_bytes(cache)
        plan = TransferPlan.make(src, dst, block_bytes)
        header: dict[str, Any] = {
            "ok": True,
            "nbytes": cache.shape[0] * len(src) * block_bytes,
            "checksum": checksum_blocks(cache, src) if msg.get("checksum") else None,
        }
        if plan is None:
            header["rows_per_chunk"] = max(1, CHUNK_BYTES // block_bytes)
        else:
            header["plan"] = plan.to_json()
        await _send_json(ep, header)
        if self.fault_delay_before_payload_s:
            await asyncio.sleep(self.fault_delay_before_payload_s)
        if plan is None:
            await _send_rows(exporter, ep, src, header["rows_per_chunk"])
        else:
            await _send_planned(exporter, ep, src, plan)

    async def probe(self, timeout: float, host: str = "127.0.0.1") -> str | None:
        """Connect to a listener of this process's own: a UCX worker wedged by a peer's death
        (see UCX_DEFAULTS) cannot complete even that handshake, while a healthy one does in a
        few ms. It tells "this process cannot connect" from "that peer does not answer". (At
        ``host``: UCX may be held to the interfaces that reach the peers, UCX_NET_DEVICES.)"""
        ucxx = _ucxx()
        reached = asyncio.Event()

        async def handler(ep: Any) -> None:
            reached.set()

        listener, ep = None, None
        try:
            listener = ucxx.create_listener(handler)
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, listener.port), timeout)
            await asyncio.wait_for(reached.wait(), timeout)
            return None
        except TimeoutError:
            return f"no UCX handshake with a listener of this process within {timeout:.1f}s"
        except Exception as e:
            return f"cannot open a UCX connection to this process: {e!r}"
        finally:
            if ep is not None:
                ep.abort()
            if listener is not None:
                listener.close()

    # ---- importer -------------------------------------------------------------------------
    async def _connect(self, handle: KvHandle) -> Any:
        peer = (handle.host, handle.port)
        if self._idle[peer]:
            return self._idle[peer].pop()
        ucxx = _ucxx()
        where = f"{handle.worker_id} at {handle.host}:{handle.port}"
        try:
            return await asyncio.wait_for(
                ucxx.create_endpoint(
                    handle.host, handle.port, connect_timeout=self.connect_timeout
                ),
                self.connect_timeout,
            )
        except TimeoutError as e:
            # A dead peer's closed port usually fails at once; a handshake that never ends is a
            # stopped or overloaded peer, or this process's UCX wedged (see UCX_DEFAULTS).
            log.error(
                "ucx_connect_timeout",
                transfer_id=handle.transfer_id,
                peer=where,
                seconds=self.connect_timeout,
                hint=WEDGED_HINT,
            )
            raise TransferError(
                "connect_timeout",
                f"transfer {handle.transfer_id}: {where} did not complete the "
                f"UCX handshake within {self.connect_timeout:.1f}s",
            ) from e
        except Exception as e:
            raise TransferError(
                "connect", f"transfer {handle.transfer_id}: cannot reach {where} ({e!r})"
            ) from e

    async def _call(
        self, handle: KvHandle, msg: dict[str, Any], sink: KvSink | None = None
    ) -> dict[str, Any]:
        """One request/response on a pooled endpoint; a broken endpoint is dropped, not reused.
        The exporter answers within ``connect_timeout`` as a new peer must: a pooled endpoint to
        a peer that stopped answering (stopped, or cut off by the network) fails as fast as a
        new one would, rather than after the whole transfer's timeout."""
        ep = await self._connect(handle)
        healthy = False
        try:
            try:
                await asyncio.wait_for(_send_json(ep, msg), self.connect_timeout)
                reply = await asyncio.wait_for(_recv_json(ep), self.connect_timeout)
            except TimeoutError:
                peer = f"{handle.worker_id} at {handle.host}:{handle.port}"
                raise TransferError(
                    "timeout",
                    f"transfer {handle.transfer_id}: {peer} did not answer within "
                    f"{self.connect_timeout:.1f}s",
                ) from None
            if sink is not None and reply.get("ok"):
                if reply["nbytes"] != sink.nbytes:
                    raise TransferError(
                        "size",
                        f"transfer {handle.transfer_id}: {reply['nbytes']} bytes offered, {sink.nbytes} expected",
                    )
                await _receive(ep, sink, reply)
            healthy = True
            return reply
        finally:
            if healthy:
                self._idle[(handle.host, handle.port)].append(ep)
            else:
                ep.abort()

    async def fetch(self, handle: KvHandle, sink: KvSink, want_checksum: bool) -> int | None:
        dst_runs = [(sink.block_ids[off], n) for off, n in block_runs(sink.block_ids)]
        msg = {
            "op": "pull",
            "transfer_id": handle.transfer_id,
            "checksum": want_checksum,
            "dst_runs": dst_runs,
        }
        reply = await self._call(handle, msg, sink)
        if not reply.get("ok"):
            peer = f"{handle.worker_id} at {handle.host}:{handle.port}"
            if reply.get("reason", "not_found") == "not_found":
                raise LeaseNotFound(handle.transfer_id, peer)
            raise TransferError(
                "refused", f"transfer {handle.transfer_id}: {peer} refused: {reply['reason']}"
            )
        crc: int | None = reply.get("checksum")
        return crc

    async def release(self, handle: KvHandle) -> None:
        await self._call(handle, {"op": "release", "transfer_id": handle.transfer_id})

    async def extend(self, handle: KvHandle, seconds: float) -> bool:
        reply = await self._call(
            handle, {"op": "extend", "transfer_id": handle.transfer_id, "seconds": seconds}
        )
        return bool(reply.get("ok"))

    async def close(self) -> None:
        for eps in self._idle.values():
            for ep in eps:
                with contextlib.suppress(Exception):
                    await ep.close()
        self._idle.clear()
        if self._listener is not None:
            # close the importers' endpoints so that their handlers end, then the listener
            for ep in list(self._served):
                with contextlib.suppress(Exception):
                    await ep.close()
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._listener.active_clients and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            self._listener.close()
            self._listener = None
