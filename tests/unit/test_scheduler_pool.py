"""SchedulerPool: which scheduler replica a gateway request goes to, against real gRPC servers
started and stopped on their ports (the pool only looks at connections, so a health service
stands in for the scheduler's port)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from ferry.gateway.errors import OpenAIError
from ferry.gateway.schedulers import SchedulerPool
from ferry.infra.ports import free_port
from tests.grpc_peer import serve
from tests.waits import wait_until_async


async def _connected(pool: SchedulerPool, n: int) -> None:
    def connected() -> bool:
        return sum(r.connected() for r in pool.replicas) == n

    await wait_until_async(f"{n} replicas connected", connected, 10)


def test_requests_go_to_the_least_busy_live_replica_in_turn() -> None:
    async def main() -> None:
        ports = [free_port(), free_port()]
        servers = [await serve(p) for p in ports]
        a, b = (f"127.0.0.1:{p}" for p in ports)
        pool = SchedulerPool([a, b, a], wait_s=5)  # a repeated address is one replica
        try:
            assert [r.address for r in pool.replicas] == [a, b]
            await _connected(pool, 2)
            assert Counter([(await pool.pick()).address for _ in range(6)]) == {a: 3, b: 3}
            first = pool.replicas[0]
            with first.streaming():  # one request in flight on a: the next ones go to b
                assert {(await pool.pick()).address for _ in range(3)} == {b}
            assert first.in_flight == 0
            assert (await pool.pick(avoid=a)).address == b
            await servers[1].stop(None)  # b is gone: everything goes to a
            await _connected(pool, 1)
            assert {(await pool.pick()).address for _ in range(4)} == {a}
            assert (await pool.pick(avoid=a)).address == a  # the only one left
        finally:
            await pool.close()
            for s in servers:
                await s.stop(None)

    asyncio.run(main())


def test_with_none_up_a_request_waits_for_the_first_that_starts() -> None:
    async def main() -> None:
        ports = [free_port(), free_port()]
        pool = SchedulerPool([f"127.0.0.1:{p}" for p in ports], wait_s=10)
        servers: list[grpc.aio.Server] = []
        try:
            picked = asyncio.create_task(pool.pick())
            # the pick has tried both replicas and found neither: it waits for one
            await wait_until_async("both replicas refused", lambda: _refused(pool), 10)
            assert not picked.done()
            servers.append(await serve(ports[1]))
            assert (await picked).address == f"127.0.0.1:{ports[1]}"
        finally:
            await pool.close()
            for s in servers:
                await s.stop(None)

    asyncio.run(main())


def _refused(pool: SchedulerPool) -> bool:
    failed = grpc.ChannelConnectivity.TRANSIENT_FAILURE
    return all(r.channel.get_state() is failed for r in pool.replicas)


def test_with_none_up_for_wait_s_a_request_is_refused_with_503() -> None:
    async def main() -> None:
        addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
        pool = SchedulerPool(addresses, wait_s=0.5)
        try:
            with pytest.raises(OpenAIError) as err:
                await pool.pick()
        finally:
            await pool.close()
        assert err.value.status == 503 and err.value.code == "scheduler_unavailable"
        assert err.value.message == (
            f"none of the 2 schedulers ({', '.join(addresses)}) answered within 0.5 s; retry later"
        )

    asyncio.run(main())
