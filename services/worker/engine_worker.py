"""EngineWorker: what the prefill, decode and aggregated workers share: one AsyncEngine, the KV
transports, their registration, load, KV events and expert load in Redis, and the health watch
that takes a worker that can no longer serve out of the cluster."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from typing import Generic, TypeVar

import grpc
import torch

from ferry.protos import common_pb2, eplb_pb2_grpc
from ferry.services.common.cluster_state import (
    ClusterStateError,
    ExpertLoadReport,
    KvEvents,
    LoadReport,
    WorkerRecord,
)
from ferry.services.common.log import get_logger
from ferry.services.common.os_thread import lower_priority
from ferry.services.common.server import RegisteredService
from ferry.services.engine.async_engine import AsyncEngine
from ferry.services.engine.engine import Engine
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.api import model_config
from ferry.services.kv_transfer.handle import LayoutFingerprint, TransferError
from ferry.services.kv_transfer.transport import KvTransport
from ferry.services.kv_transfer.ucx import WEDGED_HINT, stop_service_threads, use_service_defaults
from ferry.services.worker.config import WorkerConfig
from ferry.services.worker.engine_metrics import ENGINES
from ferry.services.worker.placement_service import SERVICE_NAME as PLACEMENT_SERVICE
from ferry.services.worker.placement_service import PlacementServicer

log = get_logger(__name__)
KV_EVENTS_PERIOD_S = 0.1
PROBE_TIMEOUT_S = 5.0  # a healthy UCX self-connection takes a few ms
PROBE_FAILURES = 2  # in a row: one slow probe on a loaded machine is not a wedge
LEAVE_MARGIN_S = 10.0  # a worker that leaves exits at most this long after its grace
KV_EVENT_ROLES = ("prefill", "aggregated")  # the workers requests start on


class EngineWorker(RegisteredService):
    """A gRPC service around one AsyncEngine, registered in Redis with its engine's facts and
    its load."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        use_service_defaults()  # a decode worker pulls over whatever transport a handle names
        lower_priority(config.nice)  # before the engine's threads start: they inherit it
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        super().__init__(config.service, self.load_report)
        self.engine = AsyncEngine(functools.partial(self._engine, config))  # built on its thread
        ENGINES.add(self.worker_id, self.engine)
        self.kv_address = ""
        self._active: set[str] = set()  # the requests this worker's RPCs are serving
        self._watch: asyncio.Task[None] | None = None
        self._publish: asyncio.Task[None] | None = None
        self._kv_events: asyncio.Task[None] | None = None
        if self.dep_group:  # (an instance attribute over the subclass's class attribute)
            self.service_names = (*self.service_names, PLACEMENT_SERVICE)

    def add_placement_service(self, server: grpc.aio.Server) -> None:
        """A DEP rank also takes the EPLB controller's placement orders."""
        if self.dep_group:
            eplb_pb2_grpc.add_ExpertPlacementServicer_to_server(PlacementServicer(self), server)

    @classmethod
    def _engine(cls, config: WorkerConfig) -> Engine:
        """The engine; on a DEP rank, after joining the group (blocks until every rank is up).
        A prefill worker computes prompts and first tokens only: it compiles no decode graphs,
        only the pieces of its eager steps (piece_graphs.py)."""
        if config.dep_size == 1:
            engine_config = config.engine
            if cls.role == "prefill":
                engine_config = dataclasses.replace(engine_config, decode_graphs=False)
            return Engine(engine_config, log=lambda msg: log.info("warming_up", step=msg))
        group = EPGroup.init(
            config.dep_size, config.dep_rank, config.dep_master, config.dep_timeout_s
        )
        mc = model_config(config.engine.model)
        placement = ExpertPlacement.spread(
            mc.num_moe_layers,
            mc.n_routed_experts,
            config.dep_size,
            config.dep_rank,
            config.num_redundant_experts,
        )
        return Engine(config.engine, placement, group)

    @property
    def dep_group(self) -> str:
        c = self.config
        return (c.dep_group or c.dep_master) if c.dep_size > 1 else ""

    @property
    def layout(self) -> LayoutFingerprint:
        info = self.engine.info
        return LayoutFingerprint.of(
            info.model_fingerprint, info.dtype, info.block_size, info.cache_spec
        )

    def record(self, address: str, metrics_port: int) -> WorkerRecord:
        info = self.engine.info
        return dataclasses.replace(
            super().record(address, metrics_port),
            kv_address=self.kv_address,
            kv_transport=self.config.kv_transport,
            model=self.config.engine.model,
            model_fingerprint=info.model_fingerprint,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            dep_group=self.dep_group,
            dep_rank=self.config.dep_rank if self.dep_group else -1,
        )

    async def start(self, address: str, metrics_port: int) -> None:
        await super().start(address, metrics_port)
        self._watch = asyncio.create_task(self._watch_health())
        self._publish = asyncio.create_task(self._publish_expert_load())
        if self.role in KV_EVENT_ROLES:
            self.engine.record_kv_events()
            self._kv_events = asyncio.create_task(self._publish_kv_events())

    async def _publish_expert_load(self) -> None:
        """Every heartbeat: this engine's expert-load window, for the EPLB controller (the
        group of an independent worker is the worker itself)."""
        group = self.dep_group or self.worker_id
        rank = self.config.dep_rank if self.dep_group else 0
        while True:
            await asyncio.sleep(self.config.service.heartbeat_s)
            load = self.engine.expert_load()
            report = ExpertLoadReport(
                counts=load.counts,
                steps_total=load.steps_total,
                updated_at=time.time(),
                placement_version=load.placement_version,
                placement_step=load.placement_step,
                snapshots=load.snapshots,
                hash_layers=load.hash_layers,
            )
            with contextlib.suppress(ClusterStateError):  # Redis away: the next beat retries
                await self.cluster.publish_expert_load(group, rank, report)

    async def _publish_kv_events(self) -> None:
        """Every KV_EVENTS_PERIOD_S with changes: this worker's prefix-cache events, for the
        schedulers' prefix indexes. The first entry, and the first after Redis was away (its
        events were lost), starts over: ``cleared`` with every hash the cache holds now."""
        start_over = True
        stateful = self.engine.stateful
        while True:
            events = self.engine.take_kv_events(snapshot=start_over)
            snaps = self.engine.take_snapshot_events(snapshot=start_over)
            if events or snaps or start_over:
                try:
                    await self.cluster.publish_kv_events(
                        KvEvents(self.worker_id, events, start_over, snaps, stateful)
                    )
                    start_over = False
                except ClusterStateError:
                    start_over = True
            await asyncio.sleep(KV_EVENTS_PERIOD_S)

    def transports(self) -> list[KvTransport]:
        """The KV transports this worker has opened (the prefill and decode workers say)."""
        return []

    async def _watch_health(self) -> None:
        """A worker that cannot serve again leaves the registry at once and stops, with a
        non-zero exit code, for its supervisor (`ferry up`) to start it afresh: its engine died
        (a DEP peer that stopped answering fails every collective), or a KV transport can no
        longer open connections (UCX wedged by a peer's death, see ucx.UCX_DEFAULTS), which
        would otherwise fail every pull while the worker looks healthy."""
        interval = self.config.kv_probe_interval_s
        next_probe, failures = time.monotonic() + interval, 0
        while self.engine.error is None:
            if interval and time.monotonic() >= next_probe:
                host = self.config.service.public_host
                probes = [await t.probe(PROBE_TIMEOUT_S, host) for t in self.transports()]
                problems = [p for p in probes if p]
                failures = failures + 1 if problems else 0
                if failures >= PROBE_FAILURES:
                    log.error("kv_transport_cannot_connect", problems=problems, hint=WEDGED_HINT)
                    return await self._leave()
                next_probe = time.monotonic() + interval
            await asyncio.sleep(0.2)
        log.error("engine failed; leaving the cluster", error=repr(self.engine.error))
        await self._leave()

    async def _leave(self) -> None:
        with contextlib.suppress(ClusterStateError):  # Redis away: the record expires instead
            await self.cluster.deregister()
        self.exit_code = 1
        # The graceful stop closes the broken part too (a wedged UCX worker, a failed process
        # group), which may not return: exit regardless once in-flight RPCs had their grace.
        deadline = threading.Timer(self.config.service.grace_s + LEAVE_MARGIN_S, os._exit, (1,))
        deadline.daemon = True
        deadline.start()
        os.kill(os.getpid(), signal.SIGTERM)  # the server's graceful stop

    def load_report(self) -> LoadReport:
        load = self.engine.load
        return LoadReport(
            running=load.running,
            waiting=load.waiting,
            queued_prefill_tokens=load.queued_prefill_tokens,
            free_kv_blocks=load.free_kv_blocks,
            total_kv_blocks=load.total_kv_blocks,
            cached_kv_blocks=load.cached_kv_blocks,
            free_state_slots=load.free_state_slots,
            total_state_slots=load.total_state_slots,
            step_time_s=load.step_time_s,
            updated_at=time.time(),
        )

    async def drain(self) -> None:
        """Stay registered, as draining, until the in-flight calls end (not deregistered)."""
        await self.cluster.drain()

    async def close(self) -> None:
        """Subclasses close their transports first, then call this."""
        for task in (self._watch, self._publish, self._kv_events):
            if task is not None:
                task.cancel()
        await super().close()
        ENGINES.remove(self.worker_id)
        self.engine.shutdown()
        stop_service_threads()


_TRANSFER_CODES = {
    "no_blocks": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "layout_mismatch": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.FAILED_PRECONDITION,
}


def transfer_status(err: TransferError) -> grpc.StatusCode:
    """The status a failed pull ends a Decode with: the exporter's failures are UNAVAILABLE."""
    return _TRANSFER_CODES.get(err.reason, grpc.StatusCode.UNAVAILABLE)


W = TypeVar("W", bound=EngineWorker)


class WorkerServicer(Generic[W]):
    """What the gRPC servicers of every worker role share (each role's servicer puts this
    before its generated base): the worker they serve, and Abort."""

    def __init__(self, worker: W) -> None:
        self.worker = worker

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortReply:
        found = request.request_id in self.worker._active
        await self.worker.engine.abort(request.request_id)
        return common_pb2.AbortReply(found=found)
