"""Prometheus metrics of the scheduler."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("ferry_scheduler_requests_total", "Generate calls by outcome", ["outcome"])
MIGRATIONS = Counter(
    "ferry_scheduler_migrations_total",
    "Requests moved to another worker after their worker failed mid-stream",
)
RETRIES = Counter("ferry_scheduler_retries_total", "Calls retried on another worker", ["stage"])
RUNNING = Gauge("ferry_scheduler_running_requests", "Generate calls in flight")
TTFT = Histogram(
    "ferry_scheduler_time_to_first_token_seconds",
    "From Generate to the first token, at the scheduler",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
GENERATED_TOKENS = Counter("ferry_scheduler_generated_tokens_total", "Tokens streamed to clients")
PROMPT_TOKENS = Counter("ferry_scheduler_prompt_tokens_total", "Prompt tokens of finished requests")
CACHED_TOKENS = Counter("ferry_scheduler_cached_tokens_total", "... of them from a prefix cache")
EXPECTED_CACHED_TOKENS = Counter(
    "ferry_scheduler_expected_cached_tokens_total",
    "Prompt tokens the prefix index said the chosen worker held, when routed (kv_aware)",
)
KV_EVENT_BATCHES = Counter(
    "ferry_scheduler_kv_event_batches_total",
    "Entries of the kv-events stream applied to this scheduler's prefix index",
)
PATHS = Counter("ferry_scheduler_path_requests_total", "Requests by path", ["path"])
