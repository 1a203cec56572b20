"""ServiceConfig: what every service process needs, whatever its role."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

MIN_TTL_S = 0.3


@dataclass(frozen=True)
class ServiceConfig:
    worker_id: str = ""  # unique name in the cluster; default "<role>-<host>-<pid>"
    host: str = "127.0.0.1"  # gRPC bind address
    port: int = 0  # 0: any free port
    advertise_host: str = ""  # the host others dial; default: host (hostname when host is 0.0.0.0)
    metrics_port: int = 0  # Prometheus /metrics; 0: any free port, -1: off
    redis_url: str = "redis://127.0.0.1:6379/0"
    cluster: str = "default"  # Redis key prefix ferry:{cluster}:
    grace_s: float = 5.0  # on SIGTERM, in-flight RPCs get this long to finish
    # a worker's registry record lives this long after its last heartbeat, and a scheduler
    # takes a worker whose record is gone for hung; every process of a cluster should agree
    ttl_s: float = 3.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be 0..65535")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port}: must be -1 (off) or 0..65535")
        if self.grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        if self.ttl_s < MIN_TTL_S:
            raise ValueError(f"heartbeat TTL {self.ttl_s} s: at least {MIN_TTL_S:g} s")

    @property
    def heartbeat_s(self) -> float:
        """Three heartbeats per TTL: a record outlives two that are late or lost."""
        return self.ttl_s / 3

    def name_for(self, role: str) -> str:
        return self.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
