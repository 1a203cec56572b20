"""The discrete-event simulation of one deployment under one load.

Ferry's own code makes every decision: each simulated rank is a real ``StepPlanner`` over a real
``KVCacheManager`` (chunked prefill, prefix hits from the chained block hashes, preemption);
the scheduler's ``RoutingPolicy`` picks the prefill and decode rank of every request from the
ranks' load reports (and, for ``kv_aware``, the prefix blocks each holds); a prefill rank holds
a finished prompt's blocks under a KV hold until the decode rank's import (``hold_new`` then
``adopt_hold``) lands. No model runs: a step takes the roofline's time (costs.py) for what its
plan computes, the slowest rank of a lockstep DEP group setting the pace, and the MoE's share
scaled by the expert imbalance that EPLB's ``rebalance`` leaves on a skewed expert popularity.

Sampling shortcut: a deployment is simulated as a *slice*, the smallest set of ranks with the
deployment's prefill:decode ratio and at least ``min_decode_ranks`` decode ranks, carrying the
same share of the sessions. The other ranks are taken to be loaded alike, so a DEP group's MoE
and all-to-all see the slice's mean tokens per rank; the simulated ranks of a role step in
lockstep (a group of ``dep`` at most). Load reports are exact (no heartbeat delay), KV transfers
do not contend with each other, and a V4 prefix hit is taken as if a state snapshot were always
kept at its end.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferry.infra.simulator.calibration import Efficiency
from ferry.infra.simulator.costs import (
    DTYPE_BYTES,
    ModelShape,
    MoeLoad,
    RankBatch,
    StepTime,
    step_time,
)
from ferry.infra.simulator.hardware import Hardware
from ferry.infra.simulator.workload import SimRequest, Workload
from ferry.services.common.cluster_state import LoadReport, WorkerRecord
from ferry.services.common.prefix_hash import prefix_hashes
from ferry.services.common.sampling_params import SamplingParams
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.engine.request import Request
from ferry.services.engine.step_planner import StepPlan, StepPlanner
from ferry.services.eplb_controller.algorithm import layer_balancedness, rebalance
from ferry.services.scheduler.policies import Candidate, RouteRequest, RoutingPolicy, create_policy

GiB = 2**30


# ---- the deployment -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """P/D split and DEP sizes; ``redundant_experts`` per DEP group (rounded up so that every
    GPU holds as many expert slots)."""

    prefill_gpus: int
    prefill_dep: int
    decode_gpus: int
    decode_dep: int
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            gpus, dep = getattr(self, f"{role}_gpus"), getattr(self, f"{role}_dep")
            if gpus < 1 or dep < 1 or gpus % dep:
                raise ValueError(f"{role}: {gpus} GPUs do not split into DEP groups of {dep}")
        if self.redundant_experts < 0:
            raise ValueError("redundant_experts must be >= 0")

    @property
    def num_gpus(self) -> int:
        return self.prefill_gpus + self.decode_gpus

    @property
    def label(self) -> str:
        red = f" +{self.redundant_experts}r" if self.redundant_experts else ""
        return (
            f"{self.prefill_gpus // self.prefill_dep}xP-DEP{self.prefill_dep} + "
            f"{self.decode_gpus // self.decode_dep}xD-DEP{self.decode_dep}{red}"
        )

    def slots_per_rank(self, m: ModelShape, dep: int) -> int:
        return expert_slots(m.num_experts, self.redundant_experts, dep) // dep

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_gpus": self.prefill_gpus,
            "prefill_dep": self.prefill_dep,
            "prefill_groups": self.prefill_gpus // self.prefill_dep,
            "decode_gpus": self.decode_gpus,
            "decode_dep": self.decode_dep,
            "decode_groups": self.decode_gpus // self.decode_dep,
            "redundant_experts": self.redundant_experts,
            "label": self.label,
        }


def expert_slots(num_experts: int, redundant: int, dep: int) -> int:
    """Physical slots per layer: at least ``num_experts + redundant``, a multiple of ``dep``."""
    return -(-(num_experts + redundant) // dep) * dep


@dataclass(frozen=True)
class SimSetup:
    """Everything but the deployment and the load."""

    hardware: Hardware
    model: ModelShape
    efficiency: Efficiency
    policy: str = "kv_aware"
    block_size: int = 64
    decode_max_num_seqs: int = 512
    decode_max_batched_tokens: int = 8192
    prefill_max_num_seqs: int = 64
    prefill_max_batched_tokens: int = 16384
    memory_utilization: float = 0.9
    workspace_bytes: float = 8 * GiB  # activations, graphs, communication buffers
    dbo: bool = True  # dual-batch overlap of the all-to-all (decode and prefill)
    expert_skew: float = 0.5  # sigma of the log-normal expert popularity per layer
    expert_drift: float = 0.2  # how far a step's popularity is from EPLB's window
    duration_s: float = 40.0  # at most, simulated
    warmup_s: float = 6.0
    min_window_s: float = 8.0
    target_requests: int = 300  # finished in the window: enough to stop early
    min_decode_ranks: int = 4
    seed: int = 0


def kv_blocks(setup: SimSetup, dep: Deployment, role: str) -> int:
    """KV blocks a rank of ``role`` holds: HBM × utilization less the weights it holds and the
    workspace (V4: and one state slot per sequence). 0 when nothing is left."""
    m, p, hw = setup.model, setup.efficiency.precision, setup.hardware
    group = dep.prefill_dep if role == "prefill" else dep.decode_dep
    weights = m.dense_params_per_rank() * DTYPE_BYTES[p.dense]
    weights += (
        dep.slots_per_rank(m, group) * m.num_moe_layers * m.expert_params * DTYPE_BYTES[p.experts]
    )
    seqs = setup.prefill_max_num_seqs if role == "prefill" else setup.decode_max_num_seqs
    free = hw.hbm_bytes * setup.memory_utilization - weights - setup.workspace_bytes
    free -= seqs * m.state_bytes_per_request(p.kv)
    per_block = setup.block_size * m.kv_bytes_per_token(p.kv)
    return max(0, int(free // per_block))


def feasibility(setup: SimSetup, dep: Deployment, longest: int) -> str | None:
    """Why ``dep`` cannot serve requests up to ``longest`` tokens, or None."""
    for role in ("prefill", "decode"):
        blocks = kv_blocks(setup, dep, role)
        if blocks * setup.block_size < longest:
            return f"{role} ranks: weights leave room for {blocks * setup.block_size} KV tokens"
    return None


# ---- EPLB's imbalance ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def imbalance_curve(
    num_experts: int,
    num_slots: int,
    n_group: int,
    dep: int,
    nodes: int,
    skew: float,
    drift: float,
    seed: int,
    layers: int = 8,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(log10 token-expert choices per step over the group, mean over layers of max/mean
    expert load per GPU). EPLB places each layer on a window's popularity; a step's choices
    are drawn from a drifted popularity, so small steps add sampling noise."""
    grid = (2, 3, 4, 5, 6, 7)
    if dep == 1:
        return tuple(map(float, grid)), (1.0,) * len(grid)
    rng = np.random.default_rng(seed)
    window = rng.lognormal(0.0, skew, (layers, num_experts))
    window /= window.sum(1, keepdims=True)
    groups = n_group if num_experts % n_group == 0 and n_group % nodes == 0 else 1
    placement = rebalance(window, num_slots, groups, nodes, dep)
    values = []
    for exp in grid:
        now = window * rng.lognormal(0.0, drift, window.shape)
        now /= now.sum(1, keepdims=True)
        counts = np.stack([rng.multinomial(int(10**exp), p) for p in now])
        values.append(float((1 / layer_balancedness(counts, placement, dep)).mean()))
    return tuple(map(float, grid)), tuple(values)


def imbalance_at(curve: tuple[tuple[float, ...], tuple[float, ...]], choices: float) -> float:
    xs, ys = curve
    return float(np.interp(math.log10(max(choices, 1.0)), xs, ys))


# ---- ranks and lockstep groups ------------------------------------------------------------------


class _NoText:
    """Requests here have no text to detokenize."""

    def push(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class Flight:
    """One request's way through the cluster, and its timestamps."""

    sim: SimRequest
    session_slot: int
    arrival: float
    prompt: list[int] = field(default_factory=list)
    hashes: tuple[int, ...] = ()
    first_token: float = -1.0
    finished: float = -1.0
    cached_tokens: int = 0


class Rank:
    """One DP rank (one GPU): a StepPlanner over its own KVCacheManager."""

    def __init__(self, name: str, role: str, setup: SimSetup, num_blocks: int) -> None:
        self.role = role
        prefill = role == "prefill"
        self.kv = KVCacheManager(num_blocks, setup.block_size, enable_prefix_caching=prefill)
        seqs = setup.prefill_max_num_seqs if prefill else setup.decode_max_num_seqs
        tokens = setup.prefill_max_batched_tokens if prefill else setup.decode_max_batched_tokens
        self.planner = StepPlanner(self.kv, seqs, tokens)
        self.record = WorkerRecord(
            name, role, "sim", block_size=setup.block_size, num_kv_blocks=num_blocks
        )
        self.flights: dict[str, Flight] = {}
        self._queued: int | None = None  # prompt tokens still to compute, while valid
        self.imports: deque[tuple[Request, Flight]] = deque()  # waiting for free blocks

    def add(self, req: Request) -> None:
        self.planner.add(req)
        if self._queued is not None:
            self._queued += req.num_tokens

    def stepped(self) -> None:
        """Its plan ran: the queued tokens are counted again when next asked for."""
        self._queued = None

    def load(self) -> LoadReport:
        """Its load report, as a worker's heartbeat would give it (but current)."""
        p = self.planner
        if self._queued is None:  # a sum over the queue: once per step, not per arrival
            queued = p.waiting + (p.running if self.role == "prefill" else [])
            self._queued = sum(r.num_tokens - r.num_computed_tokens for r in queued)
        return LoadReport(
            running=len(p.running),
            waiting=len(p.waiting) + len(self.imports),
            queued_prefill_tokens=self._queued,
            free_kv_blocks=self.kv.num_free_blocks,
            total_kv_blocks=self.kv.num_blocks,
            cached_kv_blocks=self.kv.pool.num_cached_free,
        )

    def cached_blocks(self, hashes: tuple[int, ...]) -> int:
        index = self.kv.pool.hash_to_block
        return next((i for i, h in enumerate(hashes) if h not in index), len(hashes))

    def batch(self, plan: StepPlan) -> RankBatch:
        b = RankBatch()
        for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
            if n == 1 and req.num_computed_tokens > 0:
                b.decode_contexts.append(req.num_computed_tokens + 1)
            else:
                b.prefill_chunks.append((n, req.num_computed_tokens))
        return b


class LockstepGroup:
    """Simulated ranks of one role that step together (a DEP group's all-to-all waits for its
    slowest rank); a rank with nothing to do runs an empty step."""

    def __init__(self, ranks: list[Rank], dep: int, slots_per_rank: int, curve: Any) -> None:
        self.ranks = ranks
        self.dep = dep
        self.slots_per_rank = slots_per_rank
        self.curve = curve
        self.busy = False
        self.plans: list[StepPlan] = []

    def has_work(self) -> bool:
        return any(r.planner.has_work() for r in self.ranks)

    def plan(self, setup: SimSetup, decode: bool) -> StepTime:
        self.plans = [r.planner.plan() for r in self.ranks]
        batches = [r.batch(p) for r, p in zip(self.ranks, self.plans, strict=True)]
        mean_tokens = sum(b.tokens for b in batches) / len(batches)
        choices = mean_tokens * self.dep * setup.model.top_k
        load = MoeLoad(
            self.dep, mean_tokens, imbalance_at(self.curve, choices), self.slots_per_rank
        )
        eff = setup.efficiency
        only_decode = decode and all(not b.prefill_chunks for b in batches)
        return step_time(
            setup.model,
            eff.precision,
            setup.hardware,
            eff,
            batches,
            load,
            eager=not only_decode,  # decode steps replay CUDA graphs
            overhead_s=eff.decode_overhead_s if only_decode else eff.prefill_overhead_s,
            dbo=setup.dbo,
        )


# ---- the event loop -----------------------------------------------------------------------------


@dataclass
class Slice:
    """How many ranks of each role are simulated, and the share of the deployment they are."""

    prefill_ranks: int
    decode_ranks: int
    share: float

    @classmethod
    def of(cls, dep: Deployment, min_decode_ranks: int) -> Slice:
        g = math.gcd(dep.prefill_gpus, dep.decode_gpus)
        unit_p, unit_d = dep.prefill_gpus // g, dep.decode_gpus // g
        k = min(g, max(1, -(-min(min_decode_ranks, dep.decode_gpus) // unit_d)))
        return cls(unit_p * k, unit_d * k, unit_d * k / dep.decode_gpus)


@dataclass
class Metrics:
    flights: list[Flight] = field(default_factory=list)
    output_tokens: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    prompt_tokens: list[tuple[float, int]] = field(default_factory=list)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (first token time, TTFT)
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_batch: list[int] = field(default_factory=list)
    preemptions: int = 0
    step_breakdown: dict[str, float] = field(default_factory=dict)


class Simulation:
    """One deployment, one load: ``load`` is the deployment's concurrent sessions (closed
    loop) or the speed-up of a trace's arrival times (open loop)."""

    def __init__(self, setup: SimSetup, dep: Deployment, workload: Workload, load: float) -> None:
        self.setup, self.dep, self.workload, self.load = setup, dep, workload, load
        self.slice = Slice.of(dep, setup.min_decode_ranks)
        self.policy: RoutingPolicy = create_policy(setup.policy)
        self.prefill = self._groups("prefill", self.slice.prefill_ranks, dep.prefill_dep)
        self.decode = self._groups("decode", self.slice.decode_ranks, dep.decode_dep)
        self.events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self.now = 0.0
        self.metrics = Metrics()
        self._next_session = 0
        self.sessions = 0
        self._measured = 0  # requests finished after warm-up
        # a closed-loop session's requests still to send, by the request in flight
        self._queues: dict[str, deque[SimRequest] | None] = {}

    def _groups(self, role: str, n: int, dep: int) -> list[LockstepGroup]:
        s, m = self.setup, self.setup.model
        blocks = kv_blocks(s, self.dep, role)
        if blocks == 0:
            raise ValueError(f"{self.dep.label}: the {role} ranks' weights leave no room for KV")
        slots = expert_slots(m.num_experts, self.dep.redundant_experts, dep)
        nodes = (
            max(1, dep // s.hardware.nvlink_domain) if dep % s.hardware.nvlink_domain == 0 else 1
        )
        curve = imbalance_curve(
            m.num_experts, slots, m.n_group, dep, nodes, s.expert_skew, s.expert_drift, s.seed
        )
        ranks = [Rank(f"{role}-{i}", role, s, blocks) for i in range(n)]
        size = min(dep, n)
        return [
            LockstepGroup(ranks[i : i + size], dep, slots // dep, curve) for i in range(0, n, size)
        ]

    # -- scheduling helpers --
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn, args))

    def run(self) -> Metrics:
        """Until ``duration_s``, or earlier once the window after warm-up holds
        ``target_requests`` finished requests and lasts ``min_window_s``."""
        self._start_load()
        s = self.setup
        enough_at = s.warmup_s + s.min_window_s
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            if t > s.duration_s:
                break
            self.now = t
            fn(*args)
            if t >= enough_at and self._measured >= s.target_requests:
                break
        return self.metrics

    def _start_load(self) -> None:
        if self.workload.open_loop:
            n = self.workload.num_sessions or 0
            for i in range(n):
                for r in self.workload.session(i):
                    if _in_slice(r.session, self.slice.share):
                        self.at((r.arrival_s or 0.0) / self.load, self._arrive, r, -1)
            return
        self.sessions = max(1, round(self.load * self.slice.share))
        rng = np.random.default_rng(self.setup.seed)
        for slot in range(self.sessions):
            # staggered over most of the warm-up, each slot joining its first session at a
            # random turn, so that the window sees contexts of every length
            start = float(rng.uniform(0, 0.75 * self.setup.warmup_s))
            self.at(start, self._new_session, slot, float(rng.uniform()))

    def _new_session(self, slot: int, join: float = 0.0) -> None:
        n = self.workload.num_sessions
        index = self._next_session if n is None else self._next_session % n
        self._next_session += 1
        requests = self.workload.session(index)
        skip = int(join * len(requests))
        queue = deque(requests[skip:])
        if skip and queue:  # joining mid-session: no think time before its first request
            self._warm(requests[skip - 1].prompt())
            first = queue.popleft()
            queue.appendleft(dataclasses.replace(first, think_s=0.0))
        self._send(queue, slot)

    def _warm(self, prompt: list[int]) -> None:
        """Leave ``prompt``'s blocks cached on the prefill rank the policy picks for it, at no
        cost in time: the state a session joined mid-way would have left in steady state."""
        hashes = tuple(prefix_hashes(prompt[:-1], self.setup.block_size))
        route = RouteRequest("warm", len(prompt), len(hashes), self.setup.block_size, hashes)
        rank = self._pick_prefill(route)
        req = Request("warm", prompt, SamplingParams(max_tokens=1), len(prompt) + 1, _NoText())
        cached = rank.kv.match_prefix(req)
        num_cached = len(cached[0]) * self.setup.block_size
        if rank.kv.allocate(req, len(prompt) - num_cached, cached):
            req.num_computed_tokens = len(prompt)
            rank.kv.commit(req)
        rank.kv.free(req)

    def _pick_prefill(self, route: RouteRequest) -> Rank:
        ranks = [rank for g in self.prefill for rank in g.ranks]
        pick = self.policy.pick_prefill(self._candidates(ranks, route.block_hashes), route)
        return next(x for x in ranks if x.record.worker_id == pick.worker_id)

    def _send(self, queue: deque[SimRequest], slot: int) -> None:
        if not queue:
            self._new_session(slot)
            return
        r = queue.popleft()
        self.at(self.now + r.think_s, self._arrive, r, slot, queue)

    # -- a request's way --
    def _arrive(self, r: SimRequest, slot: int, queue: deque[SimRequest] | None = None) -> None:
        f = Flight(r, slot, self.now, prompt=r.prompt())
        f.hashes = tuple(prefix_hashes(f.prompt[:-1], self.setup.block_size))
        route = RouteRequest(
            f"req-{next(self._ids)}", len(f.prompt), len(f.hashes), self.setup.block_size, f.hashes
        )
        rank = self._pick_prefill(route)
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        req = Request(route.request_id, f.prompt, params, len(f.prompt) + r.max_tokens, _NoText())
        req.hand_off = True
        rank.flights[req.request_id] = f
        self._queues[req.request_id] = queue
        rank.add(req)
        self._kick(self.prefill, decode=False)

    def _candidates(self, ranks: list[Rank], hashes: tuple[int, ...]) -> list[Candidate]:
        uses = self.policy.uses_prefixes
        return [
            Candidate(r.record, r.load(), cached_blocks=r.cached_blocks(hashes) if uses else 0)
            for r in ranks
        ]

    def _kick(self, groups: list[LockstepGroup], decode: bool) -> None:
        for g in groups:
            if g.busy or not g.has_work():
                continue
            cost = g.plan(self.setup, decode)
            g.busy = True
            self.metrics.preemptions += sum(len(p.preempted) for p in g.plans)
            done = self._decode_done if decode else self._prefill_done
            self.at(self.now + cost.total_s, done, g)
            if decode:
                self.metrics.decode_steps += 1
                self.metrics.decode_batch.append(sum(len(p.requests) for p in g.plans))
            else:
                self.metrics.prefill_steps += 1
            self._add_breakdown(cost)

    def _add_breakdown(self, cost: StepTime) -> None:
        for k, v in cost.breakdown().items():
            self.metrics.step_breakdown[k] = self.metrics.step_breakdown.get(k, 0.0) + v

    def _prefill_done(self, g: LockstepGroup) -> None:
        g.busy = False
        for rank, plan in zip(g.ranks, g.plans, strict=True):
            rank.stepped()
            for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
                req.num_computed_tokens += n
                rank.kv.commit(req)
                if req.num_computed_tokens >= len(req.prompt_token_ids):
                    self._first_token(rank, req)
        self._kick(self.prefill, decode=False)

    def _first_token(self, rank: Rank, req: Request) -> None:
        f = rank.flights.pop(req.request_id)
        f.first_token = self.now
        f.cached_tokens = req.num_cached_tokens
        self.metrics.output_tokens.append((self.now, 1))
        self.metrics.prompt_tokens.append((self.now, len(req.prompt_token_ids)))
        self.metrics.ttfts.append((self.now, self.now - f.arrival))
        hold = f"kv-{req.request_id}"
        rank.kv.hold(hold, req.block_ids)  # the lease: the blocks wait for the decode rank
        rank.planner.remove(req)
        if f.sim.max_tokens <= 1:
            rank.kv.release_hold(hold)
            self._finish(f, req.request_id)
            return
        ranks = [x for g in self.decode for x in g.ranks]
        route = RouteRequest(
            req.request_id, len(f.prompt), len(req.block_ids), self.setup.block_size
        )
        pick = self.policy.pick_decode(self._candidates(ranks, ()), route)
        target = next(x for x in ranks if x.record.worker_id == pick.worker_id)
        self.at(
            self.now + self._transfer_s(len(f.prompt)), self._imported, rank, hold, target, req, f
        )

    def _transfer_s(self, tokens: int) -> float:
        s = self.setup
        m, p, hw = s.model, s.efficiency.precision, s.hardware
        size = tokens * m.kv_bytes_per_token(p.kv) + m.state_bytes_per_request(p.kv)
        same_domain = self.dep.num_gpus <= hw.nvlink_domain
        link = hw.nvlink_one_way if same_domain else hw.scale_out_bytes_s
        return 0.5e-3 + size / (link * s.efficiency.kv_transfer)

    def _imported(self, src: Rank, hold: str, dst: Rank, pre: Request, f: Flight) -> None:
        src.kv.release_hold(hold)
        req = Request(
            pre.request_id, pre.prompt_token_ids, pre.params, pre.max_total_tokens, _NoText()
        )
        req.output_token_ids.append(0)
        dst.flights[req.request_id] = f
        dst.imports.append((req, f))
        self._admit_imports(dst)
        self._kick(self.decode, decode=True)

    def _admit_imports(self, rank: Rank) -> None:
        bs = self.setup.block_size
        while rank.imports:
            req, _ = rank.imports[0]
            n = len(req.prompt_token_ids)
            key = f"import-{req.request_id}"
            if rank.kv.hold_new(key, -(-n // bs)) is None:
                return
            rank.imports.popleft()
            rank.kv.adopt_hold(key, req, n)
            rank.planner.add_running(req)

    def _decode_done(self, g: LockstepGroup) -> None:
        g.busy = False
        made = 0
        for rank, plan in zip(g.ranks, g.plans, strict=True):
            rank.stepped()
            for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
                req.num_computed_tokens += n
                if req.num_computed_tokens < req.num_tokens:
                    continue  # a recompute chunk after a preemption
                req.output_token_ids.append(0)
                made += 1
                if len(req.output_token_ids) >= (req.params.max_tokens or 1):
                    rank.planner.remove(req)
                    self._finish(rank.flights.pop(req.request_id), req.request_id)
            self._admit_imports(rank)
        self.metrics.output_tokens.append((self.now, made))
        self._kick(self.decode, decode=True)

    def _finish(self, f: Flight, request_id: str) -> None:
        f.finished = self.now
        self.metrics.flights.append(f)
        self._measured += self.now >= self.setup.warmup_s
        queue = self._queues.pop(request_id, None)
        if queue is not None and f.session_slot >= 0:
            self._send(queue, f.session_slot)


def _in_slice(session: int, share: float) -> bool:
    """Open loop: the sessions the slice carries (a fixed hash of the session id)."""
    return (session * 2654435761 % 2**32) / 2**32 < share


# ---- a point's figures --------------------------------------------------------------------------


def summarize(sim: Simulation) -> dict[str, Any]:
    """The metrics of a finished simulation over its measuring window (after warm-up)."""
    s, m = sim.setup, sim.metrics
    start, end = s.warmup_s, min(sim.now, s.duration_s)
    window = max(end - start, 1e-9)
    gpus = sim.slice.prefill_ranks + sim.slice.decode_ranks
    out = sum(n for t, n in m.output_tokens if start <= t <= end)
    prompt = sum(n for t, n in m.prompt_tokens if start <= t <= end)
    done = [f for f in m.flights if start <= f.finished <= end]
    rates = [
        (f.sim.max_tokens - 1) / (f.finished - f.first_token)
        for f in done
        if f.sim.max_tokens > 1 and f.finished > f.first_token
    ]
    ttfts = [ttft for t, ttft in m.ttfts if start <= t <= end]
    prompt_total = sum(len(f.prompt) for f in done)
    cached = sum(f.cached_tokens for f in done)
    return {
        "tok_s_per_gpu": out / window / gpus,
        "total_tok_s_per_gpu": (out + prompt) / window / gpus,
        "tok_s_per_user": _percentiles(rates, {"p50": 50, "p90": 10}),
        "ttft_s": _percentiles(ttfts, {"p50": 50, "p99": 99}),
        "requests": len(done),
        "prefix_hit_rate": cached / prompt_total if prompt_total else 0.0,
        "mean_decode_batch_per_gpu": (
            float(np.mean(m.decode_batch)) / sim.slice.decode_ranks if m.decode_batch else 0.0
        ),
        "preemptions": m.preemptions,
        "simulated": {
            "prefill_ranks": sim.slice.prefill_ranks,
            "decode_ranks": sim.slice.decode_ranks,
            "sessions": sim.sessions,
            "seconds": round(end, 3),
            "window_s": round(window, 3),
            "prefill_steps": m.prefill_steps,
            "decode_steps": m.decode_steps,
        },
    }


def _percentiles(values: list[float], which: dict[str, float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(which)
    return {k: float(np.percentile(values, q)) for k, q in which.items()}
