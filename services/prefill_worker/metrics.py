"""Prometheus metrics of the prefill worker."""

from prometheus_client import Counter

PREFILLS = Counter("ferry_prefill_requests_total", "Prefills completed")
PREFILL_TOKENS = Counter("ferry_prefill_prompt_tokens_total", "Prompt tokens prefilled")
CACHED_TOKENS = Counter("ferry_prefill_cached_tokens_total", "Prompt tokens served from the cache")
EXPORTED_BLOCKS = Counter("ferry_prefill_exported_blocks_total", "KV blocks leased for export")
