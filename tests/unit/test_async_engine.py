"""AsyncEngine: streaming from a background step loop, aborts from the event loop."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ferry.services.common.sampling_params import StructuredOutput
from ferry.services.engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from ferry.services.engine.async_engine import EngineDeadError
from tests.waits import wait_until


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[AsyncEngine, Engine]]:
    """An AsyncEngine and the Engine it steps, which the tests inspect when it is idle."""
    inner = Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=128))
    eng = AsyncEngine(inner)
    yield eng, inner
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(engines: tuple[AsyncEngine, Engine]) -> AsyncEngine:
    return engines[0]


async def _collect(
    eng: AsyncEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str, str | None]:
    tokens: list[int] = []
    text = ""
    reason = None
    async for out in eng.generate(prompt, params):
        tokens += out.delta_token_ids
        text += out.delta_text
        reason = out.finish_reason
    return tokens, text, reason


def test_concurrent_streams_match_offline(engines: tuple[AsyncEngine, Engine]) -> None:
    engine, inner = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[i, i + 1, i + 2] * (i + 1) for i in range(8)]

    async def main() -> list[tuple[list[int], str, str | None]]:
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    results = asyncio.run(main())
    offline = Engine(EngineConfig(model="tiny", block_size=16)).generate(prompts, params)
    for (tokens, text, reason), ref in zip(results, offline, strict=True):
        assert tokens == ref.token_ids and text == ref.text and reason == "length"
    inner.check_integrity()


def test_abort_from_the_event_loop_and_on_consumer_exit(
    engines: tuple[AsyncEngine, Engine],
) -> None:
    engine, inner = engines
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main() -> tuple[str | None, int]:
        reasons: list[str | None] = []
        running = asyncio.Event()

        async def consume() -> None:
            async for out in engine.generate([1, 2, 3], long, request_id="victim"):
                reasons.append(out.finish_reason)
                running.set()

        task = asyncio.create_task(consume())
        await running.wait()
        await engine.abort("victim")
        await asyncio.wait_for(task, 10)
        # a consumer that walks away aborts its request too
        seen = 0
        async for _ in engine.generate([4, 5, 6], long, request_id="walker"):
            seen += 1
            if seen == 3:
                break
        return reasons[-1], seen

    last, seen = asyncio.run(main())
    assert last == "abort" and seen == 3
    # the walker's abort is applied before the step whose load AsyncEngine publishes next
    wait_until("the engine idle", lambda: engine.load.running + engine.load.waiting == 0, 10)
    load = engine.load
    assert load.free_kv_blocks == load.total_kv_blocks  # nothing held, the prefixes cached
    inner.check_integrity()


def test_invalid_request_raises_before_running(engine: AsyncEngine) -> None:
    async def main() -> None:
        async for _ in engine.generate([], SamplingParams()):
            pass

    with pytest.raises(ValueError, match="prompt is empty"):
        asyncio.run(main())


def test_the_engine_is_built_on_its_step_thread() -> None:
    """Built where it steps: a pool that another thread's parallel torch ops left behind would
    make libgomp's threads sleep at every barrier of every step (see async_engine.py)."""
    built_on: list[str] = []

    def build() -> Engine:
        built_on.append(threading.current_thread().name)
        return Engine(EngineConfig(model="tiny", num_kv_blocks=8))

    eng = AsyncEngine(build)
    try:
        assert built_on == ["ferry-engine"]
        assert eng.info.num_kv_blocks == 8
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        tokens, _, reason = asyncio.run(_collect(eng, [1, 2, 3], params))
        assert len(tokens) == 3 and reason == "length"
    finally:
        eng.shutdown()


def test_an_engine_that_fails_to_build_raises_from_the_constructor() -> None:
    def build() -> Engine:
        raise ValueError("no weights here")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no weights here"):
        AsyncEngine(build)
    assert "ferry-engine" not in {t.name for t in threading.enumerate()} - before


def test_shut_down_engine_refuses() -> None:
    eng = AsyncEngine(EngineConfig(model="tiny", num_kv_blocks=8))
    eng.shutdown()

    async def main() -> None:
        async for _ in eng.generate([1], SamplingParams()):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_a_grammar_compiles_off_the_engine_thread(engines: tuple[AsyncEngine, Engine]) -> None:
    """A new structured output is compiled on AsyncEngine's grammar thread while the engine
    steps on; a spec that does not compile is still refused before anything runs."""
    engine, inner = engines
    threads: list[str] = []
    compile_ = inner.grammars.compile

    def spy(spec: StructuredOutput) -> Any:
        threads.append(threading.current_thread().name)
        return compile_(spec)

    inner.grammars.compile = spy  # type: ignore[method-assign]
    try:
        regex = SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=50,
            structured_output=StructuredOutput("regex", "[xyz]{4}"),
        )
        _, text, reason = asyncio.run(_collect(engine, [1, 2, 3], regex))
        assert re.fullmatch("[xyz]{4}", text) and reason == "stop"
        bad = SamplingParams(structured_output=StructuredOutput("regex", "(x"))
        with pytest.raises(ValueError, match="does not compile"):
            asyncio.run(_collect(engine, [1, 2, 3], bad))
    finally:
        del inner.grammars.compile
    assert len(threads) == 2 and all(t.startswith("ferry-grammar") for t in threads), threads
    inner.check_integrity()
