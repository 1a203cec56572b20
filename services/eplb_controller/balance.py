"""Measured balancedness of a DEP group: from the rows each rank's experts computed, per MoE
layer, as the ranks report them (cumulative counters in their heartbeats)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np


def measured_balancedness(rows: np.ndarray) -> float:
    """``rows`` [ranks, layers] computed in some interval: mean rank / max rank, averaged over
    the layers that had traffic; 0.0 when none had."""
    peak = rows.max(axis=0)
    busy = peak > 0
    if not busy.any():
        return 0.0
    return float((rows.mean(axis=0)[busy] / peak[busy]).mean())


def aligned_rows(snapshots: list[list[list[object]]]) -> tuple[int, np.ndarray] | None:
    """The newest group step that every rank's snapshots (``[[step, rows_total], ...]`` per
    rank) hold, and the ranks' rows at it [ranks, layers]; None when there is none."""
    by_rank = [{int(step): rows for step, rows in snaps} for snaps in snapshots]  # type: ignore[call-overload]
    common = set.intersection(*(set(d) for d in by_rank)) if by_rank else set()
    if not common:
        return None
    step = max(common)
    return step, np.array([d[step] for d in by_rank])


@dataclass
class BalanceWindow:
    """Snapshots of a group's cumulative rows; the balancedness of what changed over the last
    ``window_s`` seconds, under one placement version (a new version restarts the window).

    A window without traffic (an idle group, or a placement that just switched) measures
    nothing, so :meth:`value` keeps the last value measured instead of reading 0."""

    window_s: float = 10.0
    version: int = -1
    _samples: deque[tuple[float, np.ndarray]] = field(default_factory=deque)
    _last: float | None = None

    def add(self, version: int, rows_total: np.ndarray, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if version != self.version or (
            self._samples and self._samples[-1][1].shape != rows_total.shape
        ):
            self._samples.clear()
            self.version = version
        self._samples.append((now, rows_total))
        while len(self._samples) > 2 and self._samples[1][0] < now - self.window_s:
            self._samples.popleft()

    def value(self) -> float | None:
        """Balancedness of the window's traffic, else the last measured; None before any."""
        if len(self._samples) >= 2:
            rows = self._samples[-1][1] - self._samples[0][1]
            if rows.any():
                self._last = measured_balancedness(rows)
        return self._last
