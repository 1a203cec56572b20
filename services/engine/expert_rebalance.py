"""Live expert rebalancing on a DEP rank: switch to a new ExpertPlacement while the group serves.

An order (a version and a new ``slot_to_logical`` map) reaches every rank of a group from the
EPLB controller. The ranks agree on when to start in the collective that opens every lockstep
step (each offers the newest version it holds; the group takes the smallest, so a migration
starts only once every rank has the order). Then, one MoE layer per step, every rank sends the
expert weights that the other ranks' new slots need (one uneven all-to-all), copies the ones it
already holds, and switches that layer's map: all ranks at the same step, weights and map of a
layer together. The math never changes (a slot only ever holds copies of one expert's weights),
so in-flight requests keep running and their outputs do not change.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.causal_lm import MoECausalLM


@dataclass(frozen=True)
class PlacementOrder:
    version: int  # > 0, increasing per group
    slot_to_logical: torch.Tensor  # [num_moe_layers, num_slots] int64


@dataclass
class RebalanceStats:
    """What one rank did to apply one order."""

    version: int
    slots_moved: int = 0  # this rank's slots whose expert changed
    bytes_sent: int = 0  # expert weights sent to other ranks
    bytes_received: int = 0
    seconds_paused: float = 0.0  # time the moves added to this rank's steps


class OrderRejected(ValueError):
    pass


@dataclass(frozen=True)
class Move:
    """Slot ``dst`` takes a copy of the weights now in slot ``src`` (one MoE layer)."""

    src: int
    dst: int


def layer_moves(old: list[int], new: list[int], slots_per_rank: int) -> list[Move]:
    """The copies that turn one layer's ``old`` slot map into ``new``. Every rank computes the
    same list. A slot whose expert stays is not touched; a new one copies from a replica on its
    own rank when there is one, else from a replica elsewhere (spread over the replicas)."""
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old):
        holders.setdefault(expert, []).append(slot)
    moves = []
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        if expert not in holders:
            raise OrderRejected(f"expert {expert} has no slot in the current placement")
        src = holders[expert]
        local = [s for s in src if s // slots_per_rank == slot // slots_per_rank]
        moves.append(Move(local[0] if local else src[slot % len(src)], slot))
    return moves


@dataclass
class _Migration:
    order: PlacementOrder
    future: Future[RebalanceStats]
    stats: RebalanceStats
    next_layer: int = 0


@dataclass
class Rebalancer:
    """Applies placement orders to one rank's model, in lockstep with the rest of its group.
    ``submit`` is called from any thread; ``offered`` and ``advance`` from the engine's."""

    model: MoECausalLM
    group: EPGroup
    layers_per_step: int = 1
    version: int = 0  # of the placement the model runs now (0: the starting one)
    _pending: dict[int, tuple[PlacementOrder, Future[RebalanceStats]]] = field(default_factory=dict)
    _active: _Migration | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def current(self) -> tuple[int, torch.Tensor]:
        """The version and map of the last placement applied in full (a migration in progress
        shows the one it started from)."""
        with self._lock:
            return self.version, self._applied

    def __post_init__(self) -> None:
        self._applied = self.placement.slot_to_logical

    @property
    def placement(self) -> ExpertPlacement:
        return self.model.placement

    def submit(self, order: PlacementOrder) -> Future[RebalanceStats]:
        """Queue ``order``; the future resolves once this rank runs it (or fails with the
        reason it was not applied)."""
        self._check(order)
        fut: Future[RebalanceStats] = Future()
        with self._lock:
            if order.version <= self.version:
                raise OrderRejected(
                    f"placement version {order.version} is not newer than the "
                    f"current {self.version}"
                )
            # a controller that retries after a partial failure reuses the version: latest wins
            replaced = self._pending.pop(order.version, None)
            if replaced is not None:
                replaced[1].set_exception(
                    OrderRejected(f"placement version {order.version} replaced by a newer order")
                )
            self._pending[order.version] = (order, fut)
        return fut

    def _check(self, order: PlacementOrder) -> None:
        p, s2l = self.placement, order.slot_to_logical
        if tuple(s2l.shape) != tuple(p.slot_to_logical.shape):
            raise OrderRejected(
                f"placement of shape {tuple(s2l.shape)} for a model with "
                f"{tuple(p.slot_to_logical.shape)} slots"
            )
        try:  # the same checks as the engine's own placement (every expert has a slot, ...)
            ExpertPlacement(s2l.long(), p.num_logical_experts, p.ep_size, p.ep_rank)
        except ValueError as e:
            raise OrderRejected(str(e)) from e

    @property
    def offered(self) -> int:
        """The newest version this rank could start (0: none)."""
        if self._active is not None:
            return 0
        with self._lock:
            return max(self._pending, default=0)

    def advance(self, agreed: int) -> None:
        """Called by every rank at every lockstep step with the group's agreed version (the
        smallest offer): start that order, or move the next layers of the running one."""
        if self._active is None and agreed > self.version:
            self._start(agreed)
        if self._active is not None:
            self._move_layers()

    def _start(self, version: int) -> None:
        with self._lock:
            order, fut = self._pending.pop(version)
            stale = [v for v in self._pending if v < version]
            for v in stale:
                self._pending.pop(v)[1].set_exception(
                    OrderRejected(f"placement version {v} superseded by {version}")
                )
        self._active = _Migration(order, fut, RebalanceStats(version))

    def _move_layers(self) -> None:
        m = self._active
        assert m is not None
        started = time.perf_counter()
        num_layers = self.placement.num_moe_layers
        for _ in range(self.layers_per_step):
            if m.next_layer >= num_layers:
                break
            self._move_layer(m, m.next_layer)
            m.next_layer += 1
        m.stats.seconds_paused += time.perf_counter() - started
        if m.next_layer >= num_layers:
            with self._lock:
                self.version, self._applied = m.order.version, m.order.slot_to_logical
            self._active = None
            m.future.set_result(m.stats)

    def _move_layer(self, m: _Migration, layer: int) -> None:
        p = self.placement
        old, new = p.slot_to_logical[layer].tolist(), m.order.slot_to_logical[layer].tolist()
        moves = layer_moves(old, new, p.slots_per_rank)
        experts = self.model.moe_layers()[layer].experts
        sent, received = exchange_weights(
            [experts.w13, experts.w2], moves, p.slots_per_rank, self.group
        )
        m.stats.slots_moved += sum(1 for mv in moves if mv.dst // p.slots_per_rank == p.ep_rank)
        m.stats.bytes_sent += sent
        m.stats.bytes_received += received
        rows = p.slot_to_logical.clone()
        rows[layer] = m.order.slot_to_logical[layer]
        set_placement(
            self.model, ExpertPlacement(rows, p.num_logical_experts, p.ep_size, p.ep_rank)
        )


def exchange_weights(
    weights: list[torch.Tensor], moves: list[Move], slots_per_rank: int, group: EPGroup
) -> tuple[int, int]:
    """Apply ``moves`` to this rank's local slots of every tensor in ``weights`` (each
    [slots_per_rank, ...]): one all-to-all for the copies between ranks (every rank calls it,
    with or without anything to send), local copies in place. Returns (bytes sent, received)."""
    me, spr = group.rank, slots_per_rank

    def rank_of(slot: int) -> int:
        return slot // spr

    # senders order their rows by (destination rank, destination slot); receivers expect the
    # rows of each source rank in destination-slot order: the same order
    sends = sorted(
        (mv for mv in moves if rank_of(mv.src) == me != rank_of(mv.dst)),
        key=lambda mv: (rank_of(mv.dst), mv.dst),
    )
    recvs = sorted(
        (mv for mv in moves if rank_of(mv.dst) == me != rank_of(mv.src)),
        key=lambda mv: (rank_of(mv.src), mv.dst),
    )
    local = [mv for mv in moves if rank_of(mv.src) == me == rank_of(mv.dst)]
    # [n, row]: every tensor's slot flattened side by side; gathered before anything is written
    send_rows = _rows(weights, [mv.src - me * spr for mv in sends])
    local_rows = _rows(weights, [mv.src - me * spr for mv in local])
    recv_rows = send_rows.new_empty(len(recvs), send_rows.shape[1])
    send_split = [sum(rank_of(mv.dst) == r for mv in sends) for r in range(group.size)]
    recv_split = [sum(rank_of(mv.src) == r for mv in recvs) for r in range(group.size)]
    dist.all_to_all_single(recv_rows, send_rows, recv_split, send_split, group=group.group)
    rows = torch.cat([local_rows, recv_rows])
    dsts = [mv.dst - me * spr for mv in (*local, *recvs)]
    if dsts:
        with torch.no_grad():
            offset = 0
            for w in weights:
                width = w[0].numel()
                w.data[dsts] = rows[:, offset : offset + width].reshape(len(dsts), *w.shape[1:])
                offset += width
    row_bytes = send_rows.shape[1] * send_rows.element_size()
    return len(sends) * row_bytes, len(recvs) * row_bytes


def _rows(weights: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
    """Slots ``idx`` of every tensor, flattened and side by side: [len(idx), sum of row sizes]."""
    return torch.cat([w.detach()[idx].reshape(len(idx), w[0].numel()) for w in weights], dim=1)


def set_placement(model: MoECausalLM, placement: ExpertPlacement) -> None:
    """Make ``placement`` the map of the model and every MoE layer it places (not a drafter's:
    V4.1's DSpark stages keep every expert of theirs)."""
    model.placement = placement
    for moe in model.moe_layers():
        moe.placement = placement
