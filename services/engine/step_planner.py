"""StepPlanner: which requests run in the next step, and how many tokens each brings.

vLLM-v1 style: there is no separate prefill phase. Every step first continues the running
requests in order (a decode token, or the next chunk of a long prompt), then admits waiting
requests in order, all under ``max_num_batched_tokens`` and ``max_num_seqs``. The order is
(``params.priority``, arrival): lower priorities first, first come first served among equals
(vLLM's priority policy; with every priority 0, plain FCFS). When the cache runs out of
blocks, the last running request in that order (the lowest priority, then the youngest) is
preempted: its blocks are freed and it waits to recompute its prompt and outputs (its prefix
is usually still cached).
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.engine.request import Request, Status


@dataclass
class StepPlan:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class StepPlanner:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # in order (see _order)
        self.running: list[Request] = []  # put in order at the start of every plan
        self._arrivals = itertools.count()

    def add(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        bisect.insort(self.waiting, req, key=_order)

    def add_running(self, req: Request) -> None:
        """A request that already holds the blocks of its computed tokens (an imported KV)."""
        req.arrival = next(self._arrivals)
        req.status = Status.RUNNING
        self.running.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def plan(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        budget = self._continue_running(plan, budget)
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def _continue_running(self, plan: StepPlan, budget: int) -> int:
        self.running.sort(key=_order)  # (stable; already in order unless one was added)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    return budget
            plan.requests.append(req)
            plan.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        return budget

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        # NOTE: the victim is the last running request, never one already planned this step:
        # planned requests sit before the one being allocated.
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        bisect.insort(self.waiting, req, key=_order)  # (before the younger of its priority)
        plan.preempted.append(req)

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            with self.kv.lock:  # no eviction between finding the prefix and taking it
                cached = self.kv.match_prefix(req)
                num_cached = len(cached[0]) * self.kv.block_size
                num_new = min(req.num_tokens - num_cached, budget)
                if not self.kv.allocate(req, num_new, cached):
                    break  # nobody overtakes the head of the queue
            self.waiting.pop(0)
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0 and not req.output_token_ids:
                req.num_cached_tokens = num_cached
                req.admitted_ns = time.time_ns()  # one clock read per request, for its trace
            req.status = Status.RUNNING
            self.running.append(req)
            plan.requests.append(req)
            plan.num_new_tokens.append(num_new)
            budget -= num_new


def _order(req: Request) -> tuple[int, int]:
    return req.params.priority, req.arrival
