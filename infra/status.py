"""``ferry status``: the workers in Redis, their health, load and KV usage, as a table."""

from __future__ import annotations

import time

from ferry.services.common.cluster_state import ClusterState, WorkerView

COLUMNS = (
    "worker",
    "role",
    "address",
    "health",
    "running",
    "waiting",
    "queued_tokens",
    "kv_used",
    "kv_total",
    "kv_cached",
)


def row(view: WorkerView, now: float) -> tuple[str, ...]:
    r, ld = view.record, view.load
    if ld is None:
        return (r.worker_id, r.role, r.address, "no load", "-", "-", "-", "-", "-", "-")
    age = now - ld.updated_at
    health = "ok" if age < 3 else f"stale {age:.0f}s"
    if r.draining:  # stopping: serves what it has, takes nothing new
        health = "draining" if age < 3 else f"draining, {health}"
    used = ld.total_kv_blocks - ld.free_kv_blocks
    kv = (
        (str(used), str(ld.total_kv_blocks), str(ld.cached_kv_blocks))
        if ld.total_kv_blocks
        else ("-",) * 3
    )
    return (
        r.worker_id,
        r.role,
        r.address,
        health,
        str(ld.running),
        str(ld.waiting),
        str(ld.queued_prefill_tokens),
        *kv,
    )


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *rows, strict=True)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in [COLUMNS, *rows]
    )


async def status(redis_url: str, cluster: str) -> str:
    state = ClusterState(redis_url, cluster)
    try:
        views = await state.workers(include_draining=True)
    finally:
        await state.close()
    if not views:
        return f"no workers registered in cluster {cluster!r} at {redis_url}"
    now = time.time()
    return table([row(v, now) for v in views])
