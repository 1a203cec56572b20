"""The EPLB controller's view of a group across its restarts, against a real redis-server: a
group whose ranks are new processes starts its history over, and a group gone from the
registry is forgotten with its metrics and its keys in Redis. The group's ranks here are records and load reports
written as ranks write them (no rank answers gRPC: with interval_steps 0 the controller only
measures)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ferry.services.common.cluster_state import ClusterState, ExpertLoadReport, WorkerRecord
from ferry.services.common.config import ServiceConfig
from ferry.services.eplb_controller import metrics
from ferry.services.eplb_controller.balance import measured_balancedness
from ferry.services.eplb_controller.config import EplbConfig
from ferry.services.eplb_controller.service import EplbController
from tests.redis_server import RedisServer


def _rank(rank: int, pid: int, started_at: float) -> WorkerRecord:
    return WorkerRecord(
        worker_id=f"decode-r{rank}",
        role="decode",
        address="127.0.0.1:1",
        model="tiny",
        dep_group="g",
        dep_rank=rank,
        pid=pid,
        started_at=started_at,
    )


async def _report(state: ClusterState, rank: int, step: int, rows: list[int]) -> None:
    snapshot = ExpertLoadReport(
        counts=[[0]], steps_total=step, snapshots=[[step, rows]], updated_at=time.time()
    )
    await state.publish_expert_load("g", rank, snapshot)


def _balancedness_samples() -> dict[str, float]:
    (family,) = metrics.BALANCEDNESS.collect()
    return {s.labels["group"]: s.value for s in family.samples}


def test_a_restarted_group_starts_over_and_a_gone_one_is_forgotten(redis: RedisServer) -> None:
    async def main() -> None:
        ranks = [ClusterState(redis.url, "eplb-unit", ttl_s=30) for _ in range(2)]
        service = ServiceConfig(redis_url=redis.url, cluster="eplb-unit")
        now = [0.0]  # the controller's clock: a group is forgotten 0.5 s after it left
        ctl = EplbController(EplbConfig(service=service, forget_after_s=0.5), lambda: now[0])
        try:
            # incarnation 1: rank 1 computed twice rank 0's rows (balancedness 0.75)
            for r, state in enumerate(ranks):
                await state.register(_rank(r, 100 + r, 1.0))
            for step, rows in ((10, [[10, 10], [20, 20]]), (20, [[20, 20], [40, 40]])):
                for r, state in enumerate(ranks):
                    await _report(state, r, step, rows[r])
                await ctl.poll()
            assert ctl.balancedness("g") == pytest.approx(0.75)

            # incarnation 2: new processes, steps and rows from zero, now even. Mixed with
            # the old rows the window would compare step 20's totals with step 5's.
            for r, state in enumerate(ranks):
                await state.deregister()
                await state.register(_rank(r, 200 + r, 2.0))
            for step, rows in ((5, [[1, 1], [1, 1]]), (8, [[4, 4], [4, 4]])):
                for r, state in enumerate(ranks):
                    await _report(state, r, step, rows[r])
                await ctl.poll()
            even = measured_balancedness(np.array([[3, 3], [3, 3]]))
            assert even == 1.0 and ctl.balancedness("g") == even
            assert _balancedness_samples()["g"] == even

            # gone: after forget_after_s the controller drops the group, its metrics and
            # its placement (the load reports would expire on their own)
            await ctl.cluster.save_placement("g", 1, [[1, 0]])
            for state in ranks:
                await state.deregister()
            await ctl.poll()
            assert "g" in _balancedness_samples()  # not at once
            assert await ctl.cluster.placement("g") is not None
            now[0] += 0.6
            await ctl.poll()
            assert ctl.balancedness("g") == 0.0 and "g" not in _balancedness_samples()
            assert await ctl.cluster.placement("g") is None
            assert await ctl.cluster.expert_load_reports("g") == {}
        finally:
            for state in ranks:
                await state.close()
            await ctl.cluster.close()

    asyncio.run(main())
