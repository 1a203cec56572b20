"""Routing policies: which prefill and which decode worker, or which aggregated worker,
serve a request.

A policy sees each live worker's last load report (at most a heartbeat old) corrected by what
this scheduler has routed there since that report (``Candidate.routed_*``), so that a burst of
requests does not all land on the worker that looked idlest a second ago. A prefill or
aggregated candidate also says how many leading blocks of the prompt it holds in its prefix cache
(``Candidate.cached_blocks``, from the scheduler's PrefixIndex), for the policies that ask for it.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from ferry.services.common.cluster_state import LoadReport, WorkerRecord


@dataclass(frozen=True)
class Candidate:
    record: WorkerRecord
    load: LoadReport
    routed_requests: int = 0  # sent by this scheduler after ``load`` was reported
    routed_tokens: int = 0  # their prompt tokens (prefill) ...
    routed_blocks: int = 0  # ... and the KV blocks they will take (decode)
    cached_blocks: int = 0  # leading blocks of this prompt in its prefix cache (uses_prefixes)

    @property
    def worker_id(self) -> str:
        return self.record.worker_id


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    num_prompt_tokens: int
    num_blocks: int  # KV blocks the prompt fills
    block_size: int = 1
    block_hashes: tuple[int, ...] = ()  # the chained hashes a prefix cache would match


class RoutingPolicy(ABC):
    """Picks one of ``candidates`` (never empty) for a request."""

    name = ""
    uses_prefixes = False  # wants RouteRequest.block_hashes and Candidate.cached_blocks

    @abstractmethod
    def pick_prefill(self, candidates: list[Candidate], request: RouteRequest) -> Candidate: ...

    @abstractmethod
    def pick_decode(self, candidates: list[Candidate], request: RouteRequest) -> Candidate: ...

    def pick_aggregated(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        """An aggregated worker keeps a request's KV to the end, as a decode worker does: by
        default it is picked like one."""
        return self.pick_decode(candidates, request)


POLICIES: dict[str, type[RoutingPolicy]] = {}


def register(name: str) -> Callable[[type[RoutingPolicy]], type[RoutingPolicy]]:
    def deco(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


def create_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()


@register("least_loaded")
class LeastLoaded(RoutingPolicy):
    """Prefill: fewest queued prompt tokens. Decode: most free KV blocks, then fewest running
    requests. Ties go to the lower worker id, so that the choice is deterministic."""

    def pick_prefill(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        def queued(c: Candidate) -> tuple[int, int, str]:
            load = c.load
            tokens = load.queued_prefill_tokens + c.routed_tokens
            return tokens, load.running + load.waiting + c.routed_requests, c.worker_id

        return min(candidates, key=queued)

    def pick_decode(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        def room(c: Candidate) -> tuple[int, int, str]:
            free = c.load.free_kv_blocks - c.routed_blocks
            return -free, c.load.running + c.load.waiting + c.routed_requests, c.worker_id

        return min(candidates, key=room)

    def pick_aggregated(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        """Fewest requests (its prefills and decodes share one batch), then fewest queued
        prompt tokens, then most free KV blocks."""

        def busy(c: Candidate) -> tuple[int, int, int, str]:
            load = c.load
            return (
                load.running + load.waiting + c.routed_requests,
                load.queued_prefill_tokens + c.routed_tokens,
                c.routed_blocks - load.free_kv_blocks,
                c.worker_id,
            )

        return min(candidates, key=busy)


@register("kv_aware")
class KvAware(LeastLoaded):
    """Prefix-cache aware, like Dynamo's KV router. Prefill: the least prefill work once this
    prompt is added, i.e. the worker's queued prompt tokens plus the prompt tokens it does not
    hold; aggregated: the prompt blocks it would compute plus the KV blocks its requests hold.
    Then fewest requests, then the lower worker id. Decode: as least_loaded. With no prefix
    cached anywhere it picks as least_loaded does."""

    uses_prefixes = True

    def pick_prefill(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        def work(c: Candidate) -> tuple[int, int, str]:
            new = request.num_prompt_tokens - c.cached_blocks * request.block_size
            queued = c.load.queued_prefill_tokens + c.routed_tokens
            return queued + new, c.load.running + c.load.waiting + c.routed_requests, c.worker_id

        return min(candidates, key=work)

    def pick_aggregated(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        def blocks(c: Candidate) -> tuple[int, int, str]:
            held = c.load.total_kv_blocks - c.load.free_kv_blocks + c.routed_blocks
            new = request.num_blocks - c.cached_blocks
            return held + new, c.load.running + c.load.waiting + c.routed_requests, c.worker_id

        return min(candidates, key=blocks)


@register("round_robin")
class RoundRobin(RoutingPolicy):
    """Each role's workers in turn (in worker id order), whatever their load."""

    def __init__(self) -> None:
        self._turn = {role: itertools.count() for role in ("prefill", "decode", "aggregated")}

    def _next(self, role: str, candidates: list[Candidate]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        return ordered[next(self._turn[role]) % len(ordered)]

    def pick_prefill(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        return self._next("prefill", candidates)

    def pick_decode(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        return self._next("decode", candidates)

    def pick_aggregated(self, candidates: list[Candidate], request: RouteRequest) -> Candidate:
        return self._next("aggregated", candidates)
