"""Prometheus metrics of the EPLB controller, per DEP group."""

from prometheus_client import Counter, Gauge, Histogram

BALANCEDNESS = Gauge(
    "ferry_expert_balancedness",
    "Mean rank load / max rank load of a DEP group's MoE layers over the recent window "
    "(rows its ranks' experts computed; 1 is perfect)",
    ["group"],
)
REBALANCES = Counter("ferry_eplb_rebalances_total", "Placements applied", ["group"])
SLOTS_MOVED = Counter("ferry_eplb_slots_moved_total", "Expert slots that changed expert", ["group"])
BYTES_MOVED = Counter(
    "ferry_eplb_bytes_moved_total", "Expert weight bytes sent between ranks", ["group"]
)
SECONDS_PAUSED = Histogram(
    "ferry_eplb_pause_seconds",
    "Time a rebalance added to a group's steps (its slowest rank)",
    ["group"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10),
)
PER_GROUP = (BALANCEDNESS, REBALANCES, SLOTS_MOVED, BYTES_MOVED, SECONDS_PAUSED)
