"""Waiting in tests: for a condition, never for a stretch of time.

``wait_until`` polls a check until it holds and returns what the check returned; past
``timeout`` it fails saying what it waited for (and, with ``explain``, the state that kept it
from holding). The timeout only bounds a failure: a test passes as soon as the condition
holds, however loaded the machine, so give it room (seconds where the event takes
milliseconds)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

EVERY_S = 0.05  # between two looks


def wait_until(
    what: str,
    ok: Callable[[], T],
    timeout: float = 10.0,
    every: float = EVERY_S,
    explain: Callable[[], object] | None = None,
) -> T:
    """Call ``ok()`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while not (got := ok()):
        if time.monotonic() > deadline:
            raise AssertionError(_failure(what, timeout, explain))
        time.sleep(every)
    return got


async def wait_until_async(
    what: str,
    ok: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    every: float = EVERY_S,
    explain: Callable[[], object] | None = None,
) -> T:
    """``wait_until`` on the running event loop: ``ok`` may be a coroutine function, and the
    loop runs between two looks."""
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(_failure(what, timeout, explain))
        await asyncio.sleep(every)


def _failure(what: str, timeout: float, explain: Callable[[], object] | None) -> str:
    message = f"{what}: not within {timeout:g} s"
    return f"{message}; {explain()}" if explain is not None else message
