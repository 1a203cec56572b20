"""SchedulerConfig: how the scheduler routes, retries and moves requests. No metrics here: the
CLI builds it from flags in every process."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.services.common.config import ServiceConfig
from ferry.services.scheduler.policies import POLICIES


@dataclass(frozen=True)
class SchedulerConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    routing_policy: str = "kv_aware"
    max_attempts: int = 3  # per stage (prefill, decode), first try included
    retry_backoff_s: float = 0.05  # doubled after every failed attempt
    refresh_s: float = 0.25  # how often the registry and loads are read from Redis
    migration_limit: int = 0  # moves of a request whose worker fails after streaming (0: none)

    def __post_init__(self) -> None:
        if self.routing_policy not in POLICIES:
            raise ValueError(
                f"routing_policy={self.routing_policy!r}: choose one of {', '.join(POLICIES)}"
            )
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
