"""What the prefill and decode workers share: config, the engine, the KV transport, and their
registration and load reports in Redis."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import grpc
import torch

from services.common.cluster_state import ClusterState, LoadReport, WorkerRecord
from services.common.config import ServiceConfig
from services.common.log import get_logger
from services.common.server import Service
from services.engine import AsyncEngine, EngineConfig
from services.kv_transfer import LayoutFingerprint, TransferError
from services.kv_transfer.ucx import stop_service_threads, use_service_defaults

log = get_logger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_transport: str = "ucx"
    kv_port: int = 0  # the KV transport's listener (prefill); 0: any free port
    lease_seconds: float = 30.0  # how long exported KV waits for its pull
    transfer_timeout_s: float = 30.0
    verify_checksum: bool = False  # CRC32 every transfer (tests)
    torch_threads: int = 0  # 0: torch's default

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("lease_seconds and transfer_timeout_s must be positive")
        if self.torch_threads < 0:
            raise ValueError("torch_threads must be >= 0")


class EngineWorker(Service):
    """A gRPC service around one AsyncEngine that registers itself and its load in Redis."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        use_service_defaults()  # a decode worker pulls over whatever transport a handle names
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.worker_id = config.service.name_for(self.role)
        self.engine = AsyncEngine(config.engine)
        svc = config.service
        self.cluster = ClusterState(svc.redis_url, svc.cluster, svc.heartbeat_s, svc.ttl_s)
        self.kv_address = ""

    @property
    def layout(self) -> LayoutFingerprint:
        eng = self.engine.engine
        cache = eng.kv_cache
        return LayoutFingerprint(eng.model_fingerprint, self.config.engine.dtype,
                                 cache.shape[0], cache.shape[3], cache.shape[2])  # fmt: skip

    async def start(self, address: str, metrics_port: int) -> None:
        eng = self.engine.engine
        record = WorkerRecord(
            worker_id=self.worker_id, role=self.role, address=address, kv_address=self.kv_address,
            kv_transport=self.config.kv_transport, model=self.config.engine.model,
            model_fingerprint=eng.model_fingerprint, max_model_len=eng.max_model_len,
            block_size=eng.kv.block_size, num_kv_blocks=eng.kv.num_blocks,
            metrics_port=metrics_port, pid=os.getpid(), started_at=time.time(),
        )  # fmt: skip
        await self.cluster.register(record, self.load_report)

    def load_report(self) -> LoadReport:
        load = self.engine.load
        return LoadReport(
            running=load.running, waiting=load.waiting,
            queued_prefill_tokens=load.queued_prefill_tokens, free_kv_blocks=load.free_kv_blocks,
            total_kv_blocks=load.total_kv_blocks, cached_kv_blocks=load.cached_kv_blocks,
            step_time_s=load.step_time_s, updated_at=time.time(),
        )  # fmt: skip

    async def drain(self) -> None:
        await self.cluster.deregister()

    async def close(self) -> None:
        """Subclasses close their transports first, then call this."""
        await self.cluster.close()
        self.engine.shutdown()
        stop_service_threads()


KV_ERROR_KEY = "ferry-kv-error"  # trailing metadata: the pull failed on the exporter's side

_TRANSFER_CODES = {
    "no_blocks": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "layout_mismatch": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.FAILED_PRECONDITION,
}


def transfer_status(err: TransferError) -> grpc.StatusCode:
    """The status a failed pull ends a Decode with: the exporter's failures are UNAVAILABLE."""
    return _TRANSFER_CODES.get(err.reason, grpc.StatusCode.UNAVAILABLE)
