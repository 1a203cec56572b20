"""The scheduler replicas a gateway sends requests to, and which one gets the next request.

Replicas share nothing but Redis (the workers, their load, the KV events), so any of them can
take any request. The gateway sends each request to a connected replica with the fewest of this
gateway's requests in flight (ties take turns), and one whose connection is down (dead or
restarting) gets nothing until it is back. When none is connected, a request waits up to
``wait_s`` for the first one that connects, then gets 503."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence

import grpc

from ferry.gateway.errors import OpenAIError
from ferry.protos import scheduler_pb2_grpc
from ferry.services.common.channels import open_channel

DROP_SETTLE_S = 0.2  # how long a failed call waits to see its connection go


class Replica:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = open_channel(address)  # reconnects every 0.25-1 s
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.in_flight = 0  # this gateway's requests streaming from it

    def connected(self) -> bool:
        """READY; asks an idle channel to connect, so the next look may find it up."""
        return self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY

    async def dropped(self, error: grpc.aio.AioRpcError) -> bool:
        """The call failed because the connection went (the scheduler died or is restarting),
        not because the scheduler answered UNAVAILABLE itself (its connection is still up).
        A reset stream can fail UNKNOWN ("Stream removed"), and the call can hear of the lost
        connection before the channel does: the channel gets DROP_SETTLE_S to leave READY."""
        if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
            return False
        deadline = time.monotonic() + DROP_SETTLE_S
        while self.connected():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class SchedulerPool:
    def __init__(self, addresses: Sequence[str], wait_s: float) -> None:
        self.addresses = list(dict.fromkeys(addresses))
        self.wait_s = wait_s
        self._replicas: list[Replica] | None = None
        self._turn = 0

    @property
    def replicas(self) -> list[Replica]:
        if self._replicas is None:  # the channels belong to the server's event loop
            self._replicas = [Replica(a) for a in self.addresses]
        return self._replicas

    async def pick(self, avoid: str = "") -> Replica:
        """A connected replica with the fewest requests in flight, other than ``avoid`` (one
        that just dropped a request) when there is another; none connected: wait for one."""
        live = [r for r in self.replicas if r.connected()]
        if not live:
            live = [await self._first_to_connect()]
        others = [r for r in live if r.address != avoid] or live
        self._turn += 1
        n = len(self.replicas)
        order = {r.address: (i - self._turn) % n for i, r in enumerate(self.replicas)}
        return min(others, key=lambda r: (r.in_flight, order[r.address]))

    async def _first_to_connect(self) -> Replica:
        waits = {asyncio.ensure_future(r.channel.channel_ready()): r for r in self.replicas}
        try:
            done, _ = await asyncio.wait(
                waits, timeout=self.wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        if not done:
            n, within = len(self.addresses), f"within {self.wait_s:g} s; retry later"
            why = (
                f"the scheduler at {self.addresses[0]} did not answer {within}"
                if n == 1
                else f"none of the {n} schedulers ({', '.join(self.addresses)}) answered {within}"
            )
            raise OpenAIError(503, why, "service_unavailable", code="scheduler_unavailable")
        return waits[done.pop()]

    async def close(self) -> None:
        for r in self._replicas or ():
            await r.channel.close()
