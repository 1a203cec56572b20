"""Measured balancedness from the ranks' snapshots (services/eplb_controller/balance.py)."""

from __future__ import annotations

import numpy as np

from ferry.services.eplb_controller.balance import (
    BalanceWindow,
    aligned_rows,
    measured_balancedness,
)


def test_measured_balancedness_is_mean_over_max_per_busy_layer() -> None:
    rows = np.array([[10, 0, 30], [30, 0, 30]])  # layer 1 had no traffic
    assert measured_balancedness(rows) == (20 / 30 + 1.0) / 2
    assert measured_balancedness(np.zeros((2, 3))) == 0.0


def test_aligned_rows_take_the_newest_step_every_rank_has() -> None:
    rank0 = [[16, [1, 1]], [32, [2, 2]], [48, [3, 3]]]
    rank1 = [[16, [5, 5]], [32, [6, 6]]]  # its step-48 snapshot is not reported yet
    step, rows = aligned_rows([rank0, rank1])  # type: ignore[misc]
    assert step == 32 and rows.tolist() == [[2, 2], [6, 6]]
    assert aligned_rows([rank0, [[64, [1, 1]]]]) is None
    assert aligned_rows([]) is None


def test_window_covers_recent_traffic_of_one_version() -> None:
    w = BalanceWindow(window_s=10)
    assert w.value() is None
    w.add(0, np.array([[0], [0]]), now=0)
    assert w.value() is None  # one snapshot measures nothing yet
    w.add(0, np.array([[10], [30]]), now=5)
    assert w.value() == 20 / 30
    w.add(0, np.array([[40], [60]]), now=20)  # the first sample left the window
    assert w.value() == 1.0
    w.add(1, np.array([[50], [60]]), now=21)  # a new placement starts over, and until it has
    assert w.value() == 1.0  # traffic the last measured value stands (not 0)
    w.add(1, np.array([[60], [80]]), now=22)
    assert w.value() == 15 / 20
    w.add(1, np.array([[60], [80]]), now=40)  # idle: the window holds no traffic
    w.add(1, np.array([[60], [80]]), now=41)
    assert w.value() == 15 / 20
