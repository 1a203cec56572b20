"""The engine gauges a worker's /metrics serves, read from a live AsyncEngine at scrape time."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from ferry.services.engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from ferry.services.worker.engine_metrics import EngineMetrics


def _scrape(registry: CollectorRegistry) -> dict[str, float]:
    return {
        f"{m.name}{'_total' if m.type == 'counter' else ''}": s.value
        for m in registry.collect()
        for s in m.samples
        if s.labels == {"worker": "w0"} and not s.name.endswith("_created")
    }


def test_gauges_follow_the_engine_through_a_preempting_batch() -> None:
    inner = Engine(
        EngineConfig(model="tiny", block_size=16, num_kv_blocks=24, max_num_batched_tokens=256)
    )
    engine = AsyncEngine(inner)
    metrics, registry = EngineMetrics(), CollectorRegistry()
    registry.register(metrics)
    metrics.add("w0", engine)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompts = [[(i * 7 + j) % 200 + 3 for j in range(100)] for i in range(6)]

    async def stream(prompt: list[int], first: asyncio.Event) -> int:
        n = 0
        async for out in engine.generate(prompt, params):
            n += len(out.delta_token_ids)
            first.set()
        return n

    async def main() -> tuple[dict[str, float], list[int]]:
        first = asyncio.Event()
        tasks = [asyncio.create_task(stream(p, first)) for p in prompts]
        await first.wait()
        during = _scrape(registry)
        return during, list(await asyncio.gather(*tasks))

    try:
        before = _scrape(registry)
        assert before["ferry_engine_kv_blocks"] == 24
        assert before["ferry_engine_requests_running"] == 0
        assert before["ferry_engine_kv_cache_usage_ratio"] == 0
        during, generated = asyncio.run(main())
        assert generated == [120] * 6
        # six prompts of 7 blocks each do not fit 24 blocks: some wait, the rest hold blocks
        assert during["ferry_engine_requests_running"] >= 1
        assert (
            during["ferry_engine_requests_running"] + during["ferry_engine_requests_waiting"] == 6
        )
        assert 0 < during["ferry_engine_kv_cache_usage_ratio"] <= 1
        assert during["ferry_engine_step_seconds"] > 0 and during["ferry_engine_step_tokens"] > 0
        after = _scrape(registry)
        assert after["ferry_engine_requests_running"] == after["ferry_engine_requests_waiting"] == 0
        assert after["ferry_engine_kv_cache_usage_ratio"] == 0
        assert after["ferry_engine_kv_cached_blocks"] > 0  # the prompts' blocks stay cached
        assert after["ferry_engine_preemptions_total"] == inner.num_preemptions > 0
        metrics.remove("w0")
        assert _scrape(registry) == {}
    finally:
        engine.shutdown()
