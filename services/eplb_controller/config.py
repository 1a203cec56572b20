"""EplbConfig: when the EPLB controller rebalances a group and how it applies a placement. No
metrics here: the CLI builds it from flags in every process."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.services.common.config import ServiceConfig

# hash-routed layers are rebalanced this many times less often than learned ones: their
# histogram's half-life is ten windows (engine.expert_load)
HASH_INTERVAL_FACTOR = 10


@dataclass(frozen=True)
class EplbConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    interval_steps: int = 0  # rebalance a group every this many of its steps; 0: only on request
    # its hash-routed layers (DeepSeek-V4's; their load moves slowly) every this many steps;
    # -1: HASH_INTERVAL_FACTOR x interval_steps, 0: only on request
    hash_interval_steps: int = -1
    poll_s: float = 1.0  # how often the load reports are read
    num_nodes: int = 1  # nodes a group's ranks span (the hierarchical policy packs per node)
    min_gain: float = 0.01  # apply only placements predicted to raise balancedness this much
    apply_timeout_s: float = 120.0
    window_s: float = 10.0  # measured balancedness covers this much recent traffic
    forget_after_s: float = 60.0  # what is kept about a group that left the registry this long

    def __post_init__(self) -> None:
        if self.interval_steps < 0 or self.poll_s <= 0 or self.num_nodes < 1:
            raise ValueError("interval_steps must be >= 0, poll_s > 0 and num_nodes >= 1")
        if self.hash_interval_steps < -1:
            raise ValueError("hash_interval_steps must be >= 0, or -1 for the default")

    @property
    def hash_every(self) -> int:
        """Steps between automatic rebalances of the hash-routed layers (0: never)."""
        if self.hash_interval_steps >= 0:
            return self.hash_interval_steps
        return HASH_INTERVAL_FACTOR * self.interval_steps
