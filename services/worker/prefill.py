"""PrefillWorker over gRPC: a thin adapter around an AsyncEngine whose requests hand off.

A Prefill request joins the engine's batch (chunked prefill and the prefix cache as usual), ends
after its first token, and its prompt's blocks are leased to the KV exporter; the reply carries
the first token and the KvHandle a decode worker pulls. A request whose first token already ends
it (EOS, a stop string, max_tokens=1) exports nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
from opentelemetry.trace import Span

from ferry.protos import prefill_worker_pb2, prefill_worker_pb2_grpc
from ferry.services.common import convert, tracing
from ferry.services.common.log import bind_request, get_logger
from ferry.services.common.server import abort_with
from ferry.services.engine.async_engine import EngineDeadError
from ferry.services.engine.request import RequestOutput
from ferry.services.kv_transfer.endpoints import KvExporter
from ferry.services.kv_transfer.transport import KvTransport, create_transport
from ferry.services.worker import convert as worker_convert
from ferry.services.worker.config import WorkerConfig
from ferry.services.worker.engine_worker import EngineWorker, WorkerServicer
from ferry.services.worker.metrics import prefill_metrics
from ferry.services.worker.trace_spans import prefill_spans

log = get_logger(__name__)


class PrefillWorker(EngineWorker):
    role = "prefill"
    service_names = ("ferry.v1.PrefillWorker",)

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.exporter = KvExporter(
            self.engine.kv_blocks,
            self.engine.kv_holds,
            self.layout,
            self.worker_id,
            config.lease_seconds,
        )
        self.transport = create_transport(config.kv_transport)
        self.kv_port = 0
        self.metrics = prefill_metrics()
        self._reaper: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Servicer(self), server)
        self.add_placement_service(server)

    async def start(self, address: str, metrics_port: int) -> None:
        svc = self.config.service
        self.kv_port = await self.transport.serve(self.exporter, svc.host, self.config.kv_port)
        self.kv_address = f"{svc.public_host}:{self.kv_port}"
        self._reaper = asyncio.create_task(self.exporter.run_reaper())
        await super().start(address, metrics_port)

    def transports(self) -> list[KvTransport]:
        return [self.transport]

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.transport.close()
        await super().close()

    async def prefill(
        self,
        rid: str,
        ids: list[int],
        request: prefill_worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        span: Span,
    ) -> prefill_worker_pb2.PrefillResult:
        try:
            params = convert.sampling_params_from_pb(request.sampling_params)
            resumed = worker_convert.resumed_of(request)
            out: RequestOutput | None = None
            self._active.add(rid)
            submitted_ns = time.time_ns()
            async for o in self.engine.generate(ids, params, rid, hand_off=True, resumed=resumed):
                out = o
        except ValueError as e:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, f"{self.worker_id}: {e}")
        finally:
            self._active.discard(rid)
        assert out is not None and out.finished
        prefill_spans(span, submitted_ns, out)
        span.set_attribute("cached_tokens", out.num_cached_tokens)
        result = prefill_worker_pb2.PrefillResult(
            request_id=rid, first=worker_convert.chunk_from_outputs([out])
        )
        # NOTE: usage even when the request goes on: it tells the decode worker (and so the
        # client, on the last chunk) how many prompt tokens came from the prefix cache
        result.first.usage.CopyFrom(worker_convert.usage_of(out))
        if out.kv_hold is not None:
            svc = self.config.service
            handle = self.exporter.export_hold(
                out.kv_hold, len(ids), svc.public_host, self.kv_port, self.config.kv_transport
            )
            if handle is None:
                await abort_with(context, grpc.StatusCode.ABORTED, f"request {rid} was aborted")
            else:
                result.kv_handle.CopyFrom(worker_convert.kv_handle_to_pb(handle))
                self.metrics.exported_blocks.inc(handle.num_blocks)
        self.metrics.prefills.inc()
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.cached_tokens.inc(out.num_cached_tokens)
        return result


class _Servicer(WorkerServicer[PrefillWorker], prefill_worker_pb2_grpc.PrefillWorkerServicer):
    async def Prefill(
        self, request: prefill_worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_worker_pb2.PrefillResult:
        rid = request.request_id or uuid.uuid4().hex
        ids = list(request.prompt_token_ids)
        with (
            bind_request(rid),
            tracing.span(
                "prefill",
                tracing.incoming(context),
                request_id=rid,
                worker=self.worker.worker_id,
                prompt_tokens=len(ids),
            ) as span,
        ):
            return await self.worker.prefill(rid, ids, request, context, span)

    async def Release(
        self, request: prefill_worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_worker_pb2.ReleaseReply:
        parent = tracing.incoming(context)
        with tracing.span("release", parent, transfer_id=request.transfer_id) as span:
            released = self.worker.exporter.leases.release(request.transfer_id)
            span.set_attribute("released", released)
        return prefill_worker_pb2.ReleaseReply(released=released)
