"""Live rebalancing in a real `ferry up` cluster, DeepSeek-V3, V4 and V4.1 (the last in `make
test-slow`): a decode DEP group of two
ranks with redundant experts and a skewed router serves 32 streaming requests, prefilled on a
prefill worker; the EPLB controller rebalances it in the middle (the Rebalance RPC). Every
output equals the in-process engine's (no rebalancing there), no request fails, for V3 the
balancedness measured on the ranks' real traffic is higher after than before, and every KV
block and state slot is free at the end."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from ferry.protos import eplb_pb2, eplb_pb2_grpc
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.eplb_controller.balance import measured_balancedness
from tests.cluster import Cluster, ferry_up, generate, greedy
from tests.redis_server import RedisServer
from tests.waits import wait_until_async

SKEW, TOKENS = "0.5", 128


@pytest.fixture(
    scope="module", params=["tiny", "v4-tiny", pytest.param("v41-tiny", marks=pytest.mark.slow)]
)
def model(request: pytest.FixtureRequest) -> str:
    """DeepSeek-V3, V4 and V4.1 (whose hand-offs carry the state slot into the DEP ranks)."""
    return str(request.param)


@pytest.fixture(scope="module")
def cluster(redis: RedisServer, model: str) -> Iterator[Cluster]:
    with ferry_up(
        redis.url,
        "--model",
        model,
        "--decode",
        "0",
        "--decode-dep",
        "2",
        "--num-redundant-experts",
        "2",
        "--router-skew",
        SKEW,
        "--eplb-interval-steps",
        "0",
        "--num-kv-blocks",
        "512",
        "--worker-args",
        "--block-size 16 --dep-timeout 10",
        cluster=f"eplb-{model}",  # one Redis: each model's cluster its own keys
    ) as c:
        yield c


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 3 * j) % 250 + 1 for j in range(6 + 7 * i)] for i in range(n)]


def controller(cluster: Cluster) -> str:
    (view,) = cluster.views("eplb")
    return view.record.address


async def group_rows(stub: eplb_pb2_grpc.EplbControllerStub) -> tuple[int, np.ndarray]:
    """The placement version every rank runs, and the group's cumulative rows per rank and MoE
    layer at the newest group step that every rank has reported (-1: none yet under it)."""
    (state,) = (await stub.GroupStatus(eplb_pb2.GroupStatusRequest())).groups
    rows = np.array(state.rows_total).reshape(state.ranks, state.num_moe_layers)
    under = state.version if state.rows_step >= state.placement_step else -1
    return under, rows


async def settled_rows(stub: eplb_pb2_grpc.EplbControllerStub) -> np.ndarray:
    """Rows once the ranks' reports stop changing: the same in two looks a heartbeat apart
    (they publish every heartbeat, 1 s)."""
    last = np.array([])

    async def settled() -> bool:
        nonlocal last
        _, now = await group_rows(stub)
        same = bool(now.size) and np.array_equal(now, last)
        last = now
        return same

    await wait_until_async("the ranks' reports settled", settled, 120, every=1.2)
    return last


def test_rebalance_mid_stream_keeps_outputs_and_raises_balancedness(
    cluster: Cluster, model: str
) -> None:
    ps = prompts(32)
    address = controller(cluster)

    async def main() -> tuple[list[object], eplb_pb2.GroupRebalance, list[np.ndarray]]:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = eplb_pb2_grpc.EplbControllerStub(ch)
            start = await settled_rows(stub)
            tasks = [
                asyncio.create_task(
                    generate(cluster.scheduler, p, greedy(TOKENS, ignore_eos=True), timeout=120)
                )
                for p in ps
            ]

            # rebalance once the first reports of this traffic are in (mid-stream)
            async def traffic() -> bool:
                return bool((await group_rows(stub))[1].sum() > start.sum())

            await wait_until_async("reports of the traffic", traffic, 60, every=0.2)
            mid = (await group_rows(stub))[1]

            async def rebalanced() -> eplb_pb2.GroupRebalance | None:
                (reply,) = (await stub.Rebalance(eplb_pb2.RebalanceRequest(), timeout=60)).groups
                # the ranks' first reports of this traffic may not all be in
                return None if "no expert load" in reply.reason else reply

            reply = await wait_until_async("a rebalance with load", rebalanced, 60, every=0.2)
            assert not all(t.done() for t in tasks), "the rebalance came after the traffic"

            # the first snapshot that every rank took under the new placement
            status = (-1, np.array([]))

            async def under_new() -> bool:
                nonlocal status
                status = await group_rows(stub)
                return status[0] >= reply.version

            await wait_until_async("rows under the new placement", under_new, 60, every=0.1)
            switched = status[1]
            results = await asyncio.gather(*tasks)
            end = await settled_rows(stub)
            return list(results), reply, [start, mid, switched, end]

    results, reply, (start, mid, switched, end) = asyncio.run(main())
    assert reply.applied, reply.reason
    assert reply.slots_moved > 0 and reply.bytes_moved > 0
    assert reply.predicted_balancedness_after > reply.predicted_balancedness_before
    # outputs: those of one in-process engine with every expert and the same skew
    engine = Engine(
        EngineConfig(model=model, block_size=16, num_kv_blocks=512, router_skew=float(SKEW))
    )
    expected = engine.generate(
        ps, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    )
    for i, (res, ref) in enumerate(zip(results, expected, strict=True)):
        assert res.code is None, res.details  # type: ignore[attr-defined]
        assert res.token_ids == ref.token_ids, f"request {i}"  # type: ignore[attr-defined]
    before = measured_balancedness(mid - start)
    after = measured_balancedness(end - switched)
    if model == "tiny":  # V3: the skew leaves its layers far from balanced (~0.6)
        assert after > before, (before, after)
    # v4-tiny's skewed learned layers start near 0.88 and its hash layers follow whichever tokens
    # the ranks decode in these seconds: one rebalance from a few steps' counts measured after
    # > before in 6 of 7 runs here, so it is not asserted (bench-eplb measures V4's classes)
    metrics = (
        urllib.request.urlopen(
            f"http://127.0.0.1:{cluster.views('eplb')[0].record.metrics_port}/metrics", timeout=5
        )
        .read()
        .decode()
    )
    assert 'ferry_eplb_rebalances_total{group="' in metrics
    assert "ferry_expert_balancedness{" in metrics
    cluster.wait_for("every KV block and state slot free", cluster.all_blocks_free, 10)


def test_rebalance_of_an_unknown_group_is_not_found(cluster: Cluster) -> None:
    address = controller(cluster)

    async def main() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = eplb_pb2_grpc.EplbControllerStub(ch)
            try:
                await stub.Rebalance(eplb_pb2.RebalanceRequest(group="nope"), timeout=10)
            except grpc.aio.AioRpcError as e:
                assert "nope" in (e.details() or "")
                return e.code()
            return grpc.StatusCode.OK

    assert asyncio.run(main()) == grpc.StatusCode.NOT_FOUND


def test_a_bad_placement_order_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    """Orders that do not fit the model, or are not newer, are refused with a status that says
    why; the rank keeps its placement and serves on."""
    rank0 = next(v.record for v in cluster.views("decode") if v.record.dep_rank == 0)

    async def main() -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(rank0.address) as ch:
            stub = eplb_pb2_grpc.ExpertPlacementStub(ch)
            current = await stub.GetPlacement(eplb_pb2.GetPlacementRequest(), timeout=10)
            missing = list(current.slot_to_logical)
            missing[:] = [0] * len(missing)  # every slot holds expert 0: the others have none
            orders = [
                (
                    rank0.dep_group,
                    current.num_moe_layers,
                    current.num_slots,
                    missing,
                    current.version + 1,
                ),
                (
                    rank0.dep_group,
                    current.num_moe_layers,
                    current.num_slots - 1,
                    list(current.slot_to_logical),
                    current.version + 1,
                ),
                (
                    rank0.dep_group,
                    current.num_moe_layers,
                    current.num_slots,
                    list(current.slot_to_logical),
                    current.version,
                ),
                (
                    "other-group",
                    current.num_moe_layers,
                    current.num_slots,
                    list(current.slot_to_logical),
                    current.version + 1,
                ),
            ]
            codes = []
            for group, layers, slots, s2l, version in orders:
                m = eplb_pb2.PlacementMap(
                    version=version, num_moe_layers=layers, num_slots=slots, slot_to_logical=s2l
                )
                try:
                    await stub.ApplyPlacement(
                        eplb_pb2.ApplyPlacementRequest(group=group, placement=m), timeout=10
                    )
                    codes.append((grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as e:
                    codes.append((e.code(), e.details() or ""))
            after = await stub.GetPlacement(eplb_pb2.GetPlacementRequest(), timeout=10)
            assert after == current
            return codes

    codes = asyncio.run(main())
    assert [c for c, _ in codes] == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
    ], codes
    assert "has no slot" in codes[0][1] and "slot entries" in codes[1][1]
    assert "not newer" in codes[2][1] and "other-group" in codes[3][1]
    res = asyncio.run(generate(cluster.scheduler, prompts(1)[0], greedy(4, ignore_eos=True)))
    assert res.code is None and len(res.token_ids) == 4
