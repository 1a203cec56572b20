"""The EPLB controller: watches every DEP group's expert load in Redis and moves experts while
the group serves (design.md §1, §5).

Every ``poll_s`` it reads each group's rank reports (``eplb:{group}:load``: the routing window,
the rows each rank's experts computed, steps), publishes the group's measured balancedness, and,
every ``interval_steps`` steps of the group (or on the ``Rebalance`` RPC), computes a placement
for the summed window with ``algorithm.rebalance`` (keeping slots where that costs little) and,
when it is predicted to balance better by ``min_gain``, orders every rank to apply it
(``ExpertPlacement.ApplyPlacement``, all ranks at once; they switch in lockstep). Hash-routed
layers (DeepSeek-V4's; the ranks report which) are a class of their own: their counts are a
slowly decaying token histogram, so they are only moved every ``hash_every`` steps (and on the
RPC), and a rebalance of the learned layers alone leaves their slots as they are. The applied
placement is kept in Redis (``eplb:{group}:placement``). The controller holds no state a
restart would lose: the ranks know their placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc
import numpy as np

from ferry.protos import eplb_pb2, eplb_pb2_grpc
from ferry.services.common.channels import ChannelPool
from ferry.services.common.cluster_state import ClusterStateError, ExpertLoadReport, WorkerRecord
from ferry.services.common.log import get_logger
from ferry.services.common.placement_map import placement_map, slot_map
from ferry.services.common.server import RegisteredService
from ferry.services.eplb_controller import metrics
from ferry.services.eplb_controller.algorithm import balancedness, rebalance, rebalance_layers
from ferry.services.eplb_controller.balance import BalanceWindow, aligned_rows
from ferry.services.eplb_controller.config import EplbConfig

log = get_logger(__name__)


@dataclass
class Group:
    """A DEP group as the registry shows it: its ranks' records by rank."""

    name: str
    ranks: dict[int, WorkerRecord]

    @property
    def complete(self) -> bool:
        return sorted(self.ranks) == list(range(len(self.ranks)))


@dataclass
class Schedule:
    """When a group's layers are due: the learned-routing ones every ``every`` of its steps,
    the hash-routed ones every ``hash_every`` (0: never on their own)."""

    every: int
    hash_every: int
    learned_at: int = 0
    hashed_at: int = 0

    def due(self, steps: int) -> tuple[bool, bool]:
        """(learned layers due, hash-routed layers due) at the group's step ``steps``."""
        learned = bool(self.every) and steps - self.learned_at >= self.every
        hashed = bool(self.hash_every) and steps - self.hashed_at >= self.hash_every
        return learned, hashed

    def done(self, steps: int, learned: bool, hashed: bool) -> None:
        if learned:
            self.learned_at = steps
        if hashed:
            self.hashed_at = steps


class NoRebalance(Exception):
    """Why a group keeps its placement (not an error of the controller)."""


class EplbController(RegisteredService):
    role = "eplb"
    service_names = ("ferry.v1.EplbController",)

    def __init__(self, config: EplbConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config.service)
        self.config = config
        self.clock = clock  # when groups were last seen (tests pass their own)
        self._windows: dict[str, BalanceWindow] = {}
        self._schedules: dict[str, Schedule] = {}
        self._rebalances: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._channels = ChannelPool()
        self._incarnations: dict[str, tuple[tuple[int, tuple[str, int, float]], ...]] = {}
        self._last_seen: dict[str, float] = {}  # group -> monotonic time it was registered
        self._watch: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        eplb_pb2_grpc.add_EplbControllerServicer_to_server(_Servicer(self), server)

    async def start(self, address: str, metrics_port: int) -> None:
        await super().start(address, metrics_port)
        self._watch = asyncio.create_task(self._watch_groups())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self._channels.close()
        await super().close()

    # ---- watching -------------------------------------------------------------------------
    async def groups(self) -> dict[str, Group]:
        groups: dict[str, Group] = {}
        for view in await self.cluster.workers():
            rec = view.record
            if rec.dep_group:
                groups.setdefault(rec.dep_group, Group(rec.dep_group, {})).ranks[rec.dep_rank] = rec
        return groups

    async def _watch_groups(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            try:
                await self.poll()
            except ClusterStateError as e:  # Redis away: the next poll retries
                log.warning("cannot read the cluster state", error=str(e))
            except Exception as e:  # one bad poll must not end the watch
                log.error("eplb poll failed", error=repr(e))

    async def poll(self) -> None:
        """One look at every registered group (what the watch does every ``poll_s``)."""
        groups = await self.groups()
        for group in groups.values():
            self._track(group)
            await self._observe(group)
        await self._forget_gone(groups)

    def _track(self, group: Group) -> None:
        """A group whose ranks are new processes (restarted under the same name) counts its
        steps and rows from zero again: its history starts over."""
        now = tuple(sorted((r, rec.process) for r, rec in group.ranks.items()))
        if self._incarnations.get(group.name, now) != now:
            log.info("group restarted; its history starts over", group=group.name)
            self._windows.pop(group.name, None)
            self._schedules.pop(group.name, None)
        self._incarnations[group.name] = now
        self._last_seen[group.name] = self.clock()

    async def _forget_gone(self, registered: Collection[str]) -> None:
        """Drop what is kept about groups gone from the registry for ``forget_after_s``: here,
        their metrics, and their keys in Redis (`ferry up` restarts a group under a new name).
        Not at once: after a Redis restart the registry is empty until the next heartbeats."""
        now = self.clock()
        gone = [
            g
            for g, seen in self._last_seen.items()
            if g not in registered and now - seen >= self.config.forget_after_s
        ]
        for name in gone:
            for kept in (
                self._windows,
                self._schedules,
                self._rebalances,
                self._incarnations,
                self._last_seen,
            ):
                kept.pop(name, None)
            for metric in metrics.PER_GROUP:
                with contextlib.suppress(KeyError):  # never set for this group
                    metric.remove(name)
            await self.cluster.forget_eplb_group(name)
            log.info("group forgotten", group=name)

    async def reports(self, group: Group) -> dict[int, ExpertLoadReport]:
        reports = await self.cluster.expert_load_reports(group.name)
        if not group.complete or sorted(reports) != sorted(group.ranks):
            raise NoRebalance(
                f"group {group.name}: ranks {sorted(group.ranks)} registered, "
                f"load reports from {sorted(reports)}"
            )
        return reports

    async def _observe(self, group: Group) -> None:
        try:
            reports = await self.reports(group)
        except NoRebalance:
            return
        window = self._windows.setdefault(group.name, BalanceWindow(self.config.window_s))
        version = min(r.placement_version for r in reports.values())
        since = max(r.placement_step for r in reports.values())
        aligned = aligned_rows([reports[r].snapshots for r in sorted(reports)])
        if aligned is not None and aligned[0] >= since:  # only traffic under this placement
            window.add(version, aligned[1])
            if (value := window.value()) is not None:
                metrics.BALANCEDNESS.labels(group.name).set(value)
        steps = max(r.steps_total for r in reports.values())
        schedule = self._schedules.setdefault(
            group.name, Schedule(self.config.interval_steps, self.config.hash_every)
        )
        learned, hashed = schedule.due(steps)
        if learned or hashed:
            result = await self.rebalance(group, learned, hashed)
            schedule.done(steps, learned, hashed)
            if not result.applied:
                log.info("placement kept", group=group.name, reason=result.reason)

    def balancedness(self, group: str) -> float:
        """The group's last measured balancedness; 0.0 before it has served any traffic."""
        window = self._windows.get(group)
        return (window.value() if window else None) or 0.0

    # ---- rebalancing ----------------------------------------------------------------------
    async def rebalance(
        self, group: Group, learned: bool = True, hashed: bool = True
    ) -> eplb_pb2.GroupRebalance:
        """Compute a placement for ``group`` and apply it (one rebalance per group at a time);
        ``learned`` / ``hashed``: which class of MoE layers it may move."""
        async with self._locks.setdefault(group.name, asyncio.Lock()):
            try:
                return await self._rebalance(group, learned, hashed)
            except NoRebalance as e:
                return eplb_pb2.GroupRebalance(group=group.name, applied=False, reason=str(e))

    async def _rebalance(
        self, group: Group, learned: bool, hashed: bool
    ) -> eplb_pb2.GroupRebalance:
        reports = await self.reports(group)
        weight = np.sum([np.array(r.counts) for r in reports.values()], axis=0)  # [L, E]
        if not weight.sum():
            raise NoRebalance(f"group {group.name}: no expert load reported yet")
        current = await self._stub(group.ranks[0]).GetPlacement(
            eplb_pb2.GetPlacementRequest(), timeout=self.config.apply_timeout_s
        )
        prev = slot_map(current)
        size = len(group.ranks)
        groups = current.num_expert_groups  # the model's, as the rank reports it
        if not groups:
            raise NoRebalance(
                f"group {group.name}: its rank 0 did not report the model's expert groups"
            )
        hash_layers = set(reports[0].hash_layers)
        layers = [
            layer
            for layer in range(weight.shape[0])
            if (hashed if layer in hash_layers else learned)
        ]
        args = (prev.shape[1], groups, self.config.num_nodes, size, prev)
        if len(layers) == weight.shape[0]:
            new = rebalance(weight, *args)
        elif layers:
            new = rebalance_layers(weight, *args, layers)
        else:
            raise NoRebalance(f"group {group.name}: no MoE layer of the class that is due")
        before, after = balancedness(weight, prev, size), balancedness(weight, new, size)
        result = eplb_pb2.GroupRebalance(
            group=group.name,
            predicted_balancedness_before=before,
            predicted_balancedness_after=after,
        )
        if not new.slots_moved:
            raise NoRebalance(
                f"group {group.name}: the current placement is already the best found"
            )
        if after < before + self.config.min_gain:
            raise NoRebalance(
                f"group {group.name}: predicted balancedness {before:.3f} -> "
                f"{after:.3f}, less than the minimum gain {self.config.min_gain}"
            )
        version = current.version + 1
        applied = await self._apply(group, version, new.phy2log)
        await self.cluster.save_placement(group.name, version, new.phy2log.tolist())
        result.applied, result.version = True, version
        result.slots_moved = sum(a.slots_moved for a in applied)
        result.bytes_moved = sum(a.bytes_received for a in applied)
        result.seconds_paused = max(a.seconds_paused for a in applied)
        self._rebalances[group.name] = self._rebalances.get(group.name, 0) + 1
        metrics.REBALANCES.labels(group.name).inc()
        metrics.SLOTS_MOVED.labels(group.name).inc(result.slots_moved)
        metrics.BYTES_MOVED.labels(group.name).inc(result.bytes_moved)
        metrics.SECONDS_PAUSED.labels(group.name).observe(result.seconds_paused)
        log.info(
            "rebalanced",
            group=group.name,
            version=version,
            before=round(before, 3),
            after=round(after, 3),
            slots_moved=result.slots_moved,
            bytes_moved=result.bytes_moved,
            seconds_paused=result.seconds_paused,
        )
        return result

    async def _apply(
        self, group: Group, version: int, phy2log: np.ndarray
    ) -> list[eplb_pb2.PlacementApplied]:
        """Order every rank at once; the ranks start moving weights when all of them have it."""
        order = eplb_pb2.ApplyPlacementRequest(
            group=group.name, placement=placement_map(version, phy2log)
        )
        calls = [
            self._stub(rec).ApplyPlacement(order, timeout=self.config.apply_timeout_s)
            for _, rec in sorted(group.ranks.items())
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for (rank, rec), res in zip(sorted(group.ranks.items()), results, strict=True):
            if isinstance(res, BaseException):
                detail = res.details() if isinstance(res, grpc.aio.AioRpcError) else repr(res)
                raise NoRebalance(
                    f"group {group.name}: rank {rank} ({rec.worker_id}) did not "
                    f"apply version {version}: {detail}"
                )
        return list(results)  # type: ignore[arg-type]

    def _stub(self, rec: WorkerRecord) -> eplb_pb2_grpc.ExpertPlacementStub:
        channel = self._channels.get(rec.address, rec.process)
        return eplb_pb2_grpc.ExpertPlacementStub(channel)

    async def status(self, group: Group) -> eplb_pb2.GroupState:
        state = eplb_pb2.GroupState(
            group=group.name,
            ranks=len(group.ranks),
            balancedness=self.balancedness(group.name),
            rebalances=self._rebalances.get(group.name, 0),
        )
        try:
            reports = await self.reports(group)
        except NoRebalance:
            return state
        ordered = [reports[r] for r in sorted(reports)]
        state.version = min(r.placement_version for r in ordered)  # what every rank runs
        state.placement_step = max(r.placement_step for r in ordered)
        aligned = aligned_rows([r.snapshots for r in ordered])
        if aligned is not None:
            state.rows_step, rows = aligned
            state.num_moe_layers = rows.shape[1]
            state.rows_total.extend(int(v) for v in rows.reshape(-1))
        return state


class _Servicer(eplb_pb2_grpc.EplbControllerServicer):
    def __init__(self, controller: EplbController) -> None:
        self.c = controller

    async def _chosen(self, name: str, context: grpc.aio.ServicerContext) -> list[Group]:
        try:
            groups = await self.c.groups()
        except ClusterStateError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if name and name not in groups:
            known = ", ".join(sorted(groups)) or "none"
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no DEP group {name!r} is registered (groups: {known})"
            )
        return [groups[name]] if name else [groups[g] for g in sorted(groups)]

    async def Rebalance(
        self, request: eplb_pb2.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.RebalanceReply:
        groups = await self._chosen(request.group, context)
        return eplb_pb2.RebalanceReply(groups=[await self.c.rebalance(g) for g in groups])

    async def GroupStatus(
        self, request: eplb_pb2.GroupStatusRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.GroupStatusReply:
        groups = await self._chosen(request.group, context)
        return eplb_pb2.GroupStatusReply(groups=[await self.c.status(g) for g in groups])
