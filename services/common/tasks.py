"""Stopping a background task for good."""

from __future__ import annotations

import asyncio

RECANCEL_S = 0.05  # how long one cancellation gets before the next


async def stop(task: asyncio.Task[object] | None) -> None:
    """Cancel ``task`` until it has ended. One cancellation is not always enough: redis-py (8.2)
    can swallow one that lands inside a call, and a loop that rides out Redis errors goes on
    (seen: a scheduler whose view refresher outlived its SIGTERM, so the process never exited).
    Each retry cancels whatever the loop awaits next."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error  # it had failed on its own: as awaiting it would say
