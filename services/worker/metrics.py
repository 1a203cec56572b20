"""Prometheus metrics of the worker roles' RPCs: what the prefill and decode servicers count as
they serve (the engine's own gauges, read when Prometheus scrapes: ``engine_metrics.py``).

Each role's families are registered when its first worker is built, not when this module is
imported: a process exports its own role's families only (a prefill worker no
``ferry_decode_*``). The aggregated worker serves the decode API and counts as a decode worker.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import Counter, Histogram


@dataclass(frozen=True)
class PrefillMetrics:
    prefills: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    exported_blocks: Counter


@dataclass(frozen=True)
class DecodeMetrics:
    rejected: Counter
    failed_pulls: Counter
    coalesced: Histogram


@functools.cache
def prefill_metrics() -> PrefillMetrics:
    return PrefillMetrics(
        prefills=Counter("ferry_prefill_requests_total", "Prefills completed"),
        prompt_tokens=Counter("ferry_prefill_prompt_tokens_total", "Prompt tokens prefilled"),
        cached_tokens=Counter(
            "ferry_prefill_cached_tokens_total", "Prompt tokens served from the cache"
        ),
        exported_blocks=Counter(
            "ferry_prefill_exported_blocks_total", "KV blocks leased for export"
        ),
    )


@functools.cache
def decode_metrics() -> DecodeMetrics:
    return DecodeMetrics(
        rejected=Counter("ferry_decode_rejected_total", "Decodes refused as RESOURCE_EXHAUSTED"),
        failed_pulls=Counter("ferry_decode_failed_pulls_total", "KV pulls that failed", ["reason"]),
        coalesced=Histogram(
            "ferry_decode_tokens_per_message",
            "Engine steps coalesced into one streamed message",
            buckets=(1, 2, 4, 8, 16, 32),
        ),
    )
