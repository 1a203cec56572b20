"""The ExpertPlacement service every DEP rank serves: the EPLB controller's orders go in here and
reach the engine's Rebalancer (services/engine/expert_rebalance.py), which applies them in
lockstep with the rest of the group."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import torch

from ferry.protos import eplb_pb2, eplb_pb2_grpc
from ferry.services.common.log import get_logger
from ferry.services.common.placement_map import placement_map, slot_map
from ferry.services.engine.expert_rebalance import OrderRejected, PlacementOrder

if TYPE_CHECKING:
    from ferry.services.worker.engine_worker import EngineWorker

log = get_logger(__name__)
SERVICE_NAME = "ferry.v1.ExpertPlacement"


class PlacementServicer(eplb_pb2_grpc.ExpertPlacementServicer):
    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    async def ApplyPlacement(
        self, request: eplb_pb2.ApplyPlacementRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.PlacementApplied:
        rebalancer = self.worker.engine.rebalancer
        assert rebalancer is not None  # only DEP ranks serve this
        if request.group != self.worker.dep_group:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this rank belongs to group {self.worker.dep_group!r}, not {request.group!r}",
            )
        version = request.placement.version
        try:
            order = PlacementOrder(version, torch.from_numpy(slot_map(request.placement)))
            future = rebalancer.submit(order)
        except OrderRejected as e:
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if version <= rebalancer.version
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, f"placement version {version}: {e}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"placement: {e}")
        log.info("placement_order", version=version, group=request.group)
        try:
            stats = await asyncio.wrap_future(future)  # resolved by the engine thread
        except OrderRejected as e:  # superseded by a newer order before it started
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        log.info(
            "placement_applied",
            version=version,
            slots_moved=stats.slots_moved,
            bytes_received=stats.bytes_received,
            seconds_paused=stats.seconds_paused,
        )
        return eplb_pb2.PlacementApplied(
            version=stats.version,
            slots_moved=stats.slots_moved,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            seconds_paused=stats.seconds_paused,
        )

    async def GetPlacement(
        self, request: eplb_pb2.GetPlacementRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.PlacementMap:
        rebalancer = self.worker.engine.rebalancer
        assert rebalancer is not None
        reply = placement_map(*rebalancer.current())
        reply.num_expert_groups = self.worker.engine.info.num_expert_groups
        return reply
