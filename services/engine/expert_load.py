"""How many tokens each MoE layer routed to each logical expert, over a sliding window of steps:
what the EPLB controller balances (design.md §1: expert load in Redis).

The counts stay on the model's device and are added without a host sync (the MoE layers call
``add`` on the per-step path); only ``window()``, read once per heartbeat, copies to the host.
The window slides in buckets of ``bucket_steps`` steps, so it holds a few tensors, not one per
step.

Hash-routed layers (DeepSeek-V4's first MoE layers: experts from ``tid2eid[token id]``) are a
class of their own: nothing steers them, and their load is a fixed function of which tokens
come, which moves slowly. Their rows are counted from a histogram of the token ids on the host
(``add_tokens``), decayed with a half-life of ``HASH_HALF_LIFE_STEPS`` steps, ten windows:
every token adds one to each expert its table row names, twice for an expert named twice.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

HASH_HALF_LIFE_STEPS = 10_000


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
        self.hash_tables: dict[int, torch.Tensor] = {}  # MoE layer -> tid2eid [vocab, top_k]
        self._tokens: torch.Tensor | None = None  # the decayed token histogram, float64
        self._decay = 1.0

    @property
    def hash_layers(self) -> list[int]:
        return sorted(self.hash_tables)

    def count_by_token(
        self, tables: dict[int, torch.Tensor], half_life_steps: int = HASH_HALF_LIFE_STEPS
    ) -> None:
        """Count the MoE layers of ``tables`` (their ``tid2eid``) from the tokens fed
        (``add_tokens``) instead of from their routing."""
        if not tables:
            return
        self.hash_tables = {layer: t.detach().cpu().long() for layer, t in tables.items()}
        vocab = next(iter(self.hash_tables.values())).shape[0]
        self._tokens = torch.zeros(vocab, dtype=torch.float64)
        self._decay = 0.5 ** (self.bucket_steps / half_life_steps)

    def add_tokens(self, token_ids: torch.Tensor) -> None:
        """The token ids a step fed (on the host), for the hash-routed layers."""
        if self._tokens is not None and token_ids.numel():
            with self._lock:
                self._tokens.index_add_(
                    0, token_ids, torch.ones(len(token_ids), dtype=torch.float64)
                )

    def add(self, moe_layer: int, logical_ids: torch.Tensor) -> None:
        """One layer's routing this step: ``logical_ids`` [tokens, top_k]."""
        if not logical_ids.numel() or moe_layer in self.hash_tables:
            return
        if self._current is None:
            self._current = torch.zeros(self.shape, dtype=torch.long, device=logical_ids.device)
        self._current[moe_layer] += torch.bincount(logical_ids.reshape(-1), minlength=self.shape[1])

    def counts_buffer(self, device: torch.device) -> torch.Tensor:
        """The bucket being filled, as one [num_moe_layers * num_experts] int64 tensor that a
        compiled step adds its choices into (``MoECausalLM.decode_graph``): nothing left to do
        on the host (a bincount per step is a few percent of a small model's decode step). The
        step leaves the rows
        of hash-routed layers alone: they count from the tokens (``add_tokens``)."""
        if self._current is None:
            self._current = torch.zeros(self.shape, dtype=torch.long, device=device)
        return self._current.view(-1)

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
            if self._tokens is not None:
                self._tokens *= self._decay
        self._current = None
        self._steps_in_current = 0

    def window(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] tokens routed over the window, on the host; the
        hash-routed layers' rows from the decayed token histogram (rounded)."""
        with self._lock:
            parts = [*self._buckets, *([self._current] if self._current is not None else [])]
            tokens = None if self._tokens is None else self._tokens.clone()
        total = torch.zeros(self.shape, dtype=torch.long)
        for p in parts:
            total += p.cpu()
        if tokens is not None:
            top_k = next(iter(self.hash_tables.values())).shape[1]
            per_choice = tokens.repeat_interleave(top_k)  # every table names top_k a token
            for layer, table in self.hash_tables.items():
                row = torch.zeros(self.shape[1], dtype=torch.float64)
                total[layer] = row.index_add_(0, table.reshape(-1), per_choice).round().long()
        return total
