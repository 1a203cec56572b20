"""Prometheus metrics of KV transfer (both sides)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

TRANSFER_BYTES = Counter("ferry_kv_transfer_bytes_total", "KV bytes received", ["transport"])
TRANSFERS = Counter("ferry_kv_transfers_total", "KV transfers completed", ["transport"])
TRANSFER_SECONDS = Histogram(
    "ferry_kv_transfer_seconds",
    "Duration of one KV pull",
    ["transport"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
FAILED_TRANSFERS = Counter(
    "ferry_kv_transfer_failures_total", "Failed KV pulls", ["transport", "reason"]
)
FAILED_RELEASES = Counter(
    "ferry_kv_release_failures_total",
    "Pulls that landed but could not tell the exporter (its lease expires instead)",
    ["transport"],
)
EXPIRED_LEASES = Counter("ferry_kv_leases_expired_total", "KV leases that expired unpulled")
