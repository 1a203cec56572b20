"""`ferry status`'s table rows: health says whether a worker beats and whether it drains."""

from __future__ import annotations

from infra.status import row
from services.common.cluster_state import LoadReport, WorkerRecord, WorkerView


def _health(draining: bool, age: float) -> str:
    record = WorkerRecord("decode-0", "decode", "127.0.0.1:1", draining=draining)
    load = LoadReport(total_kv_blocks=8, free_kv_blocks=6, updated_at=100.0)
    return row(WorkerView(record, load), now=100.0 + age)[3]


def test_health_column() -> None:
    assert _health(False, 0.5) == "ok"
    assert _health(False, 5.0) == "stale 5s"
    assert _health(True, 0.5) == "draining"
    assert _health(True, 5.0) == "draining, stale 5s"
