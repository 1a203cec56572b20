"""How many tokens each MoE layer routed to each logical expert, over a sliding window of steps:
what the EPLB controller balances (design.md §1: expert load in Redis)."""

from __future__ import annotations

import threading
from collections import deque

import torch


class ExpertLoad:
    """The MoE layers add their per-step counts; ``window()`` sums the last ``window_steps``."""

    def __init__(self, num_moe_layers: int, num_experts: int, window_steps: int = 1000) -> None:
        self.shape = (num_moe_layers, num_experts)
        self._step = torch.zeros(self.shape, dtype=torch.long)
        self._steps: deque[torch.Tensor] = deque(maxlen=window_steps)
        self._total = torch.zeros(self.shape, dtype=torch.long)
        self._lock = threading.Lock()  # the engine thread adds, a heartbeat reads

    def add(self, moe_layer: int, logical_ids: torch.Tensor) -> None:
        """One layer's routing this step: ``logical_ids`` [tokens, top_k]."""
        if logical_ids.numel():
            self._step[moe_layer] += torch.bincount(logical_ids.reshape(-1).cpu(),
                                                    minlength=self.shape[1])  # fmt: skip

    def end_step(self) -> None:
        with self._lock:
            if len(self._steps) == self._steps.maxlen:
                self._total -= self._steps[0]
            self._steps.append(self._step)
            self._total += self._step
        self._step = torch.zeros(self.shape, dtype=torch.long)

    def window(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] tokens routed over the window."""
        with self._lock:
            return self._total.clone()
