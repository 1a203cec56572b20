"""DecodeWorker over gRPC: pull a prefill's KV, join the running batch, stream the tokens.

Admission happens before any block moves: a worker that is at ``max_num_seqs`` or lacks the
blocks answers RESOURCE_EXHAUSTED so that the scheduler tries another. The pull lands in blocks
held under the import's key; the engine adopts them, so a cancelled or failed Decode at any
point leaves no block behind. When the reader lags, the tokens of several steps go out as one
TokenChunk. The aggregated worker (``aggregated.py``) serves the same API.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import Span

from ferry.protos import common_pb2, decode_worker_pb2, decode_worker_pb2_grpc
from ferry.services.common import convert, tracing
from ferry.services.common.convert import KV_ERROR_KEY
from ferry.services.common.log import bind_request, get_logger
from ferry.services.common.sampling_params import SamplingParams
from ferry.services.common.server import abort_with
from ferry.services.engine.async_engine import EngineDeadError
from ferry.services.engine.request import ImportedKv, Resumed
from ferry.services.kv_transfer.endpoints import KvImporter
from ferry.services.kv_transfer.handle import KvHandle, TransferError
from ferry.services.kv_transfer.transport import KvTransport, create_transport
from ferry.services.worker import convert as worker_convert
from ferry.services.worker.config import WorkerConfig
from ferry.services.worker.engine_worker import (
    PROBE_TIMEOUT_S,
    EngineWorker,
    WorkerServicer,
    transfer_status,
)
from ferry.services.worker.metrics import decode_metrics
from ferry.services.worker.trace_spans import prefill_spans

log = get_logger(__name__)


class DecodeWorker(EngineWorker):
    role = "decode"
    service_names = ("ferry.v1.DecodeWorker",)
    prefills = False  # True: a Decode without a kv_handle is prefilled here

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._importers: dict[str, KvImporter] = {}
        self.metrics = decode_metrics()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Servicer(self), server)
        self.add_placement_service(server)

    def importer(self, transport: str) -> KvImporter:
        """One importer (and endpoint pool) per transport that exporters offer."""
        if transport not in self._importers:
            self._importers[transport] = KvImporter(
                create_transport(transport),
                self.engine.kv_blocks,
                self.engine.kv_holds,
                self.layout,
                self.config.transfer_timeout_s,
                self.config.verify_checksum,
            )
        return self._importers[transport]

    async def start(self, address: str, metrics_port: int) -> None:
        # the transport its peers export over, ready before any request: else the first pull
        # pays for UCX's start-up, orders of magnitude longer than a pull
        transport = self.importer(self.config.kv_transport).transport
        await transport.probe(PROBE_TIMEOUT_S, self.config.service.public_host)
        await super().start(address, metrics_port)

    def transports(self) -> list[KvTransport]:
        return [imp.transport for imp in self._importers.values()]

    async def close(self) -> None:
        for imp in self._importers.values():
            await imp.transport.close()
        await super().close()

    def admission_error(self, num_blocks: int) -> str | None:
        """Why this worker cannot take a request whose prompt fills ``num_blocks`` now, or None."""
        load = self.engine.load
        limit = self.config.engine.max_num_seqs
        # a pull in flight counts: its request needs a state slot (V4) once it lands
        if max(load.running + load.waiting, len(self._active)) >= limit:
            return f"{self.worker_id} is full: {limit} requests running (max_num_seqs)"
        if load.free_kv_blocks < num_blocks + 1:
            return (
                f"{self.worker_id} has {load.free_kv_blocks} free KV blocks; the request needs "
                f"{num_blocks + 1}"
            )
        return None

    async def pull(self, handle: KvHandle, context: grpc.aio.ServicerContext, parent: Span) -> str:
        """Pull the handle's blocks into a hold; returns the hold's key."""
        importer = self.importer(handle.transport)
        with tracing.span(
            "kv_transfer",
            parent,
            transport=handle.transport,
            blocks=handle.num_blocks,
            bytes=handle.num_blocks * self.layout.block_bytes,
            exporter=handle.worker_id,
        ) as span:
            started = time.perf_counter()
            try:
                await importer.pull(handle)
            except TransferError as e:
                span.set_attribute("error", e.reason)
                context.set_trailing_metadata(((KV_ERROR_KEY, e.reason),))
                self.metrics.failed_pulls.labels(e.reason).inc()
                await abort_with(context, transfer_status(e), str(e))
            span.set_attribute("seconds", round(time.perf_counter() - started, 6))
        return importer.hold_key(handle)


def _parse(
    request: decode_worker_pb2.DecodeRequest, prefills: bool
) -> tuple[list[int], SamplingParams, KvHandle | None, Resumed | None]:
    """The request's prompt, sampling params, KV handle (None: prefill it here) and where it
    resumes (None: it starts here)."""
    if not request.HasField("kv_handle") and not prefills:
        raise ValueError("kv_handle is missing")
    params = convert.sampling_params_from_pb(request.sampling_params)
    handle = (
        worker_convert.kv_handle_from_pb(request.kv_handle)
        if request.HasField("kv_handle")
        else None
    )
    return list(request.prompt_token_ids), params, handle, worker_convert.resumed_of(request)


class _Servicer(WorkerServicer[DecodeWorker], decode_worker_pb2_grpc.DecodeWorkerServicer):
    async def Decode(
        self, request: decode_worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        w = self.worker
        rid = request.request_id
        parent = tracing.incoming(context)
        with (
            bind_request(rid),
            tracing.span(w.role, parent, request_id=rid, worker=w.worker_id) as span,
        ):
            try:
                ids, params, handle, resumed = _parse(request, w.prefills)
                w.engine.validate(ids, params)
            except ValueError as e:
                await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            num_blocks = handle.num_blocks if handle else w.engine.blocks_needed(len(ids))
            busy = w.admission_error(num_blocks)
            if busy is not None:
                w.metrics.rejected.inc()
                await abort_with(context, grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
            key = ""
            w._active.add(rid)
            steps = tracing.Steps.of(span)
            try:
                imported = None
                if handle is not None:
                    key = await w.pull(handle, context, span)
                    imported = ImportedKv(
                        key,
                        request.first_token_id,
                        worker_convert.logprobs_from_pb(request.first_logprobs),
                        request.num_cached_tokens,
                    )
                submitted_ns = time.time_ns()
                async for outs in w.engine.stream(
                    ids, params, rid, imported=imported, resumed=resumed
                ):
                    w.metrics.coalesced.observe(len(outs))
                    if steps is not None:
                        if not steps.count and imported is None:  # it was prefilled here
                            prefill_spans(span, submitted_ns, outs[0])
                        steps.add(len(outs), sum(len(o.delta_token_ids) for o in outs))
                    yield worker_convert.chunk_from_outputs(outs)
            except (ValueError, KeyError) as e:
                await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except EngineDeadError as e:
                await abort_with(context, grpc.StatusCode.UNAVAILABLE, f"{w.worker_id}: {e}")
            finally:
                w._active.discard(rid)
                if key:  # a no-op once the engine adopted the blocks
                    w.engine.kv_holds.release_hold(key)
                if steps is not None:
                    steps.close()
