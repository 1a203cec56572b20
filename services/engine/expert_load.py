"""How many tokens each MoE layer routed to each logical expert, over a sliding window of steps:
what the EPLB controller balances (design.md §1: expert load in Redis).

The counts stay on the model's device and are added without a host sync (the MoE layers call
``add`` on the per-step path); only ``window()``, read once per heartbeat, copies to the host.
The window slides in buckets of ``bucket_steps`` steps, so it holds a few tensors, not one per
step.
"""

from __future__ import annotations

import threading
from collections import deque

import torch


class ExpertLoad:
    def __init__(
        self,
        num_moe_layers: int,
        num_experts: int,
        window_steps: int = 1000,
        bucket_steps: int = 100,
    ) -> None:
        self.shape = (num_moe_layers, num_experts)
        self.bucket_steps = max(1, min(bucket_steps, window_steps))
        self._buckets: deque[torch.Tensor] = deque(maxlen=max(1, window_steps // self.bucket_steps))
        self._current: torch.Tensor | None = None  # the bucket being filled, on the device
        self._steps_in_current = 0
        self._lock = threading.Lock()  # the engine thread adds, a heartbeat reads
        # Since start, on the host: steps, and (token, choice) rows this rank's experts computed
        # per MoE layer (on a DEP rank, what the rank's share of the group's load really was).
        self.steps_total = 0
        self.rows_total = [0] * num_moe_layers
        # (group step, rows_total) every SNAPSHOT_STEPS lockstep steps of a DEP group: the ranks
        # of a group take theirs at the same steps, so the controller can compare like with like
        self.snapshots: deque[tuple[int, list[int]]] = deque(maxlen=8)

    def add(self, moe_layer: int, logical_ids: torch.Tensor) -> None:
        """One layer's routing this step: ``logical_ids`` [tokens, top_k]."""
        if not logical_ids.numel():
            return
        if self._current is None:
            self._current = torch.zeros(self.shape, dtype=torch.long, device=logical_ids.device)
        self._current[moe_layer] += torch.bincount(logical_ids.reshape(-1), minlength=self.shape[1])

    def add_rows(self, moe_layer: int, rows: int) -> None:
        self.rows_total[moe_layer] += rows

    def snapshot(self, group_step: int) -> None:
        with self._lock:
            self.snapshots.append((group_step, list(self.rows_total)))

    def recent_snapshots(self) -> list[list[object]]:
        """[[group step, rows_total], ...], oldest first (any thread)."""
        with self._lock:
            return [[step, rows] for step, rows in self.snapshots]

    def end_step(self) -> None:
        self.steps_total += 1
        self._steps_in_current += 1
        if self._steps_in_current < self.bucket_steps or self._current is None:
            return
        with self._lock:
            self._buckets.append(self._current)
        self._current = None
        self._steps_in_current = 0

    def window(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] tokens routed over the window, on the host."""
        with self._lock:
            parts = [*self._buckets, *([self._current] if self._current is not None else [])]
        total = torch.zeros(self.shape, dtype=torch.long)
        for p in parts:
            total += p.cpu()
        return total
