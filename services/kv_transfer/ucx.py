"""UCX transport over ucxx: a listener on the exporter, pooled async endpoints on the importer.

Per transfer, on one endpoint: the importer sends a JSON request, the exporter answers with a
JSON header naming the layer chunks, then sends the staged payload chunk by chunk (rendezvous
protocol: UCX writes each straight into the importer's staging tensor). The exporter gathers
chunk i+1 from its cache while chunk i is on the wire, and the importer scatters chunk i into its
cache while chunk i+1 arrives. CPU buffers go over TCP or shared memory here; a CUDA tensor
would go the same way without a host copy.
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
    TransferPlan,
    block_runs,
    checksum_blocks,
    gather_layers,
    layer_block_bytes,
    layer_chunks,
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
    if "chunks" in header:  # staged on both sides
        for l0, l1 in header["chunks"]:
            await ep.recv(_bytes_view(sink.staged()[l0:l1]))
            sink.landed(l0, l1)
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
        crc = checksum_blocks(cache, src) if msg.get("checksum") else None
        num_layers = cache.shape[0]
        # Staged sends go out in layer chunks: chunk i+1 is gathered while chunk i is sent.
        chunks = layer_chunks(num_layers, len(src) * block_bytes)
        header: dict[str, Any] = {
            "ok": True,
            "nbytes": num_layers * len(src) * block_bytes,
            "checksum": crc,
        }
        header.update({"chunks": chunks} if plan is None else {"plan": plan.to_json()})
        await _send_json(ep, header)
        if self.fault_delay_before_payload_s:
            await asyncio.sleep(self.fault_delay_before_payload_s)

        staged = None if plan is not None and plan.src_in_place else exporter.take_staging(len(src))
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
            if plan is None:
                assert staged is not None
                await ep.send(_bytes_view(staged[l0:l1]))
                continue
            for layer in range(l0, l1):
                for off, n in plan.pieces:
                    if staged is None:  # in place: the run straight out of the cache
                        part = cache[layer, src[off] : src[off] + n]
                    else:
                        part = staged[layer, off : off + n]
                    await ep.send(_bytes_view(part))
        if staged is not None:
            exporter.unstage(
                staged
            )  # only after every send completed: a failed one may still read it

    async def probe(self, timeout: float) -> str | None:
        """Connect to a listener of this process's own: a UCX worker wedged by a peer's death
        (see UCX_DEFAULTS) cannot complete even that handshake, while a healthy one does in a
        few ms. It tells "this process cannot connect" from "that peer does not answer"."""
        ucxx = _ucxx()
        reached = asyncio.Event()

        async def handler(ep: Any) -> None:
            reached.set()

        listener, ep = None, None
        try:
            listener = ucxx.create_listener(handler)
            ep = await asyncio.wait_for(ucxx.create_endpoint("127.0.0.1", listener.port), timeout)
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
        """One request/response on a pooled endpoint; a broken endpoint is dropped, not reused."""
        ep = await self._connect(handle)
        healthy = False
        try:
            await _send_json(ep, msg)
            reply = await _recv_json(ep)
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
