"""AsyncEngine: streaming from a background step loop, aborts from the event loop."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ferry.services.engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from ferry.services.engine.async_engine import EngineDeadError
from ferry.services.engine.sampling_params import StructuredOutput


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=128))
    yield eng
    eng.shutdown()


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


def test_concurrent_streams_match_offline(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[i, i + 1, i + 2] * (i + 1) for i in range(8)]

    async def main() -> list[tuple[list[int], str, str | None]]:
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    results = asyncio.run(main())
    offline = Engine(EngineConfig(model="tiny", block_size=16)).generate(prompts, params)
    for (tokens, text, reason), ref in zip(results, offline, strict=True):
        assert tokens == ref.token_ids and text == ref.text and reason == "length"
    engine.engine.check_integrity()


def test_abort_from_the_event_loop_and_on_consumer_exit(engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main() -> tuple[str | None, int]:
        reasons: list[str | None] = []

        async def consume() -> None:
            async for out in engine.generate([1, 2, 3], long, request_id="victim"):
                reasons.append(out.finish_reason)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
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
    for _ in range(100):
        if not engine.engine.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not engine.engine.has_unfinished_requests()
    engine.engine.check_integrity()
    assert engine.engine.kv.usage()["in_use"] == 0


def test_invalid_request_raises_before_running(engine: AsyncEngine) -> None:
    async def main() -> None:
        async for _ in engine.generate([], SamplingParams()):
            pass

    with pytest.raises(ValueError, match="prompt is empty"):
        asyncio.run(main())


def test_shut_down_engine_refuses() -> None:
    eng = AsyncEngine(Engine(EngineConfig(model="tiny", num_kv_blocks=8)))
    eng.shutdown()

    async def main() -> None:
        async for _ in eng.generate([1], SamplingParams()):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_a_grammar_compiles_off_the_engine_thread(engine: AsyncEngine) -> None:
    """A new structured output is compiled on AsyncEngine's grammar thread while the engine
    steps on; a spec that does not compile is still refused before anything runs."""
    threads: list[str] = []
    compile_ = engine.engine.grammars.compile

    def spy(spec: StructuredOutput) -> Any:
        threads.append(threading.current_thread().name)
        return compile_(spec)

    engine.engine.grammars.compile = spy  # type: ignore[method-assign]
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
        del engine.engine.grammars.compile
    assert len(threads) == 2 and all(t.startswith("ferry-grammar") for t in threads), threads
    engine.engine.check_integrity()
