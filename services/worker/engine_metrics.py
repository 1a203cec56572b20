"""What a worker's engine holds, on its ``/metrics``: requests running and waiting, the KV
cache's use, preemptions and the last step (vLLM's ``num_requests_running``,
``kv_cache_usage_perc``, ``num_preemptions``...). Read when Prometheus scrapes, not pushed by
every step: the engine's step loop pays nothing for them.

Each sample carries the worker's id (a test process may hold several workers)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ferry.services.engine.async_engine import AsyncEngine


class EngineMetrics(Collector):
    def __init__(self) -> None:
        self._engines: weakref.WeakValueDictionary[str, AsyncEngine] = weakref.WeakValueDictionary()

    def add(self, worker_id: str, engine: AsyncEngine) -> None:
        self._engines[worker_id] = engine

    def remove(self, worker_id: str) -> None:
        self._engines.pop(worker_id, None)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"ferry_engine_{name}", doc, labels=["worker"])

        running = gauge("requests_running", "Requests in the engine's batch")
        waiting = gauge("requests_waiting", "Requests queued for admission (preempted included)")
        queued = gauge("queued_prefill_tokens", "Prompt tokens not yet computed")
        blocks = gauge("kv_blocks", "KV cache blocks in all")
        cached = gauge("kv_cached_blocks", "Free blocks that still hold a cached prefix")
        usage = gauge(
            "kv_cache_usage_ratio",
            "Blocks held by requests or KV leases, of all (cached prefixes not counted)",
        )
        step = gauge("step_seconds", "The last step: plan, forward, sampling")
        step_tokens = gauge("step_tokens", "Tokens the last step computed")
        preemptions = CounterMetricFamily(
            "ferry_engine_preemptions",
            "Requests preempted (their blocks freed, recomputed later)",
            labels=["worker"],
        )
        for worker, engine in list(self._engines.items()):
            load = engine.load
            running.add_metric([worker], load.running)
            waiting.add_metric([worker], load.waiting)
            queued.add_metric([worker], load.queued_prefill_tokens)
            blocks.add_metric([worker], load.total_kv_blocks)
            cached.add_metric([worker], load.cached_kv_blocks)
            used = load.total_kv_blocks - load.free_kv_blocks
            usage.add_metric([worker], used / load.total_kv_blocks if load.total_kv_blocks else 0)
            step.add_metric([worker], load.step_time_s)
            step_tokens.add_metric([worker], load.step_tokens)
            preemptions.add_metric([worker], load.num_preemptions)
        yield from (running, waiting, queued, blocks, cached, usage, step, step_tokens, preemptions)


ENGINES = EngineMetrics()
REGISTRY.register(ENGINES)
