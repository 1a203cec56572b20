"""WorkerConfig: what an engine worker runs (its engine, KV transport, DEP group). No torch:
the CLI builds it from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.services.common.config import ServiceConfig
from ferry.services.engine.config import EngineConfig

MAX_NICE = 19  # the lowest priority Linux has


@dataclass(frozen=True)
class WorkerConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_transport: str = "ucx"
    kv_port: int = 0  # the KV transport's listener (prefill); 0: any free port
    lease_seconds: float = 30.0  # how long exported KV waits for its pull
    transfer_timeout_s: float = 30.0
    verify_checksum: bool = False  # CRC32 every transfer (tests)
    kv_probe_interval_s: float = 5.0  # how often the KV transports check they can connect
    torch_threads: int = 0  # 0: torch's default
    # lower CPU priority (nice): where workers share cores, the others go first
    nice: int = 0
    dep_size: int = 1  # ranks in this worker's DEP group (1: not a group)
    dep_rank: int = 0
    dep_master: str = ""  # host:port where rank 0 meets the others
    dep_group: str = ""  # the group's name in Redis (default: the master's address)
    num_redundant_experts: int = 0
    dep_timeout_s: float = 10.0  # a rank silent this long fails its group's collectives

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("lease_seconds and transfer_timeout_s must be positive")
        if self.torch_threads < 0:
            raise ValueError("torch_threads must be >= 0")
        if not 0 <= self.nice <= MAX_NICE:
            raise ValueError(f"nice must be in 0..{MAX_NICE}")
        if self.kv_probe_interval_s < 0:
            raise ValueError("kv_probe_interval_s must be >= 0 (0: no probes)")
        if self.dep_size < 1 or not 0 <= self.dep_rank < self.dep_size:
            raise ValueError(f"dep_rank {self.dep_rank} outside 0..{self.dep_size - 1}")
        if self.dep_size > 1 and not self.dep_master:
            raise ValueError("a DEP group (dep_size > 1) needs dep_master host:port")
