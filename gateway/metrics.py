"""The gateway's Prometheus metrics, as a client sees the service."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(
    "ferry_gateway_requests_total",
    "HTTP API requests by endpoint and status",
    ["endpoint", "status"],
)
PROMPT_TOKENS = Counter("ferry_gateway_prompt_tokens_total", "prompt tokens of served requests")
COMPLETION_TOKENS = Counter("ferry_gateway_completion_tokens_total", "tokens generated")
TTFT = Histogram(
    "ferry_gateway_time_to_first_token_seconds", "request received → first token", buckets=_LATENCY
)
ITL = Histogram(
    "ferry_gateway_inter_token_latency_seconds", "gap between a choice's tokens", buckets=_LATENCY
)
MIGRATIONS = Counter(
    "ferry_gateway_migrations_total",
    "Streams that went on through another scheduler after theirs went away mid-stream",
)
E2E = Histogram(
    "ferry_gateway_e2e_latency_seconds", "request received → last token", buckets=_LATENCY
)
