"""tasks.stop: a background loop ends even when it swallows a cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ferry.services.common import tasks
from tests.waits import wait_until_async


class Flaky(Exception):
    """What a client library raised instead of the CancelledError it was given."""


async def _call(calls: list[int]) -> None:
    """A client call that, the first time, turns its cancellation into an error of its own (as
    redis-py may when a cancellation lands at the wrong moment inside it)."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        if len(calls) == 1:
            raise Flaky from None
        raise


async def _loop(calls: list[int]) -> None:
    """A refresher that rides out its client's errors, as ClusterView.run does Redis's."""
    while True:
        calls.append(1)
        with contextlib.suppress(Flaky):
            await _call(calls)
        await asyncio.sleep(0.01)


def test_a_loop_that_swallowed_its_cancellation_still_stops() -> None:
    async def run() -> tuple[bool, bool]:
        calls: list[int] = []
        task = asyncio.create_task(_loop(calls))
        await wait_until_async("the loop in its call", lambda: calls, 5, every=0)
        task.cancel()  # the first one is swallowed: a plain `await task` would wait for ever
        await wait_until_async(
            "the loop back in its call, or ended", lambda: len(calls) == 2 or task.done(), 5, 0
        )
        still_running = not task.done()
        await asyncio.wait_for(tasks.stop(task), 5)
        return still_running, task.cancelled()

    still_running, cancelled = asyncio.run(run())
    assert still_running and cancelled


def test_stop_says_how_a_task_that_failed_on_its_own_ended() -> None:
    async def fails() -> None:
        raise ValueError("its own error")

    async def run() -> None:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await tasks.stop(task)

    with pytest.raises(ValueError, match="its own error"):
        asyncio.run(run())
    asyncio.run(tasks.stop(None))  # nothing to stop
