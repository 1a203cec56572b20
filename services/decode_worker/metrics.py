"""Prometheus metrics of the decode worker."""

from prometheus_client import Counter, Histogram

REJECTED = Counter("ferry_decode_rejected_total", "Decodes refused as RESOURCE_EXHAUSTED")
FAILED_PULLS = Counter("ferry_decode_failed_pulls_total", "KV pulls that failed", ["reason"])
COALESCED = Histogram(
    "ferry_decode_tokens_per_message",
    "Engine steps coalesced into one streamed message",
    buckets=(1, 2, 4, 8, 16, 32),
)
