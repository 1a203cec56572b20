"""ChannelPool: one channel per peer process, a fresh one for a process restarted on the same
address (a real gRPC server stopped and started again on its port). Fresh means its own
connection: gRPC shares them among a process's channels by default, and a new channel to the
restarted peer then failed at once, in the old one's reconnect back-off."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferry.infra.ports import free_port
from ferry.services.common import channels
from ferry.services.common.channels import ChannelPool
from tests.grpc_peer import serve, serve_in_process


async def _check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_a_restarted_peer_gets_a_new_channel_that_works_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # gRPC's own reconnect back-off (1 s, growing), so that the old channel is surely in it
    kept = [o for o in channels.channel_options() if not o[0].endswith("reconnect_backoff_ms")]
    monkeypatch.setattr(channels, "channel_options", lambda: kept)

    async def main() -> None:
        port = free_port()
        address = f"127.0.0.1:{port}"
        pool = ChannelPool()
        server = await serve(port)
        try:
            first = pool.get(address, ("pid", 1))
            assert pool.get(address, ("pid", 1)) is first
            assert await _check(first) is grpc.StatusCode.OK
            await server.stop(None)
            for _ in range(4):  # refused: gRPC backs off its reconnects, failing calls at once
                assert await _check(first) is grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.3)
            server = await serve(port)
            second = pool.get(address, ("pid", 2))  # the registry shows a new process
            assert second is not first and len(pool) == 1
            assert await _check(second) is grpc.StatusCode.OK
            await asyncio.sleep(0)  # the old channel's close runs
            with pytest.raises(Exception, match="Channel is closed"):  # grpc's UsageError
                await _check(first)
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(main())


def test_keepalive_is_one_setting_of_the_process() -> None:
    def ping_ms() -> set[int]:
        names = (
            "grpc.keepalive_time_ms",
            "grpc.keepalive_timeout_ms",
            "grpc.http2.ping_timeout_ms",
        )
        opts = [*channels.channel_options(), *channels.server_options()]
        return {value for name, value in opts if name in names}

    assert ping_ms() == {3000}
    channels.configure(20)
    try:
        assert ping_ms() == {20000}
        with pytest.raises(ValueError, match=r"keepalive 0\.5 s: at least 1 s"):
            channels.configure(0.5)
        assert ping_ms() == {20000}
    finally:
        channels.configure(channels.KEEPALIVE_S)


def test_a_stream_from_a_peer_that_hangs_fails_unavailable() -> None:
    """A server process stopped (SIGSTOP) mid-stream sends nothing and closes nothing; our
    channels' keepalive pings (here every second) go unanswered and the stream fails
    UNAVAILABLE (2-3 s; a minute with gRPC's default ping timeout, hence the bound)."""
    port = free_port()
    server = serve_in_process(port)
    channels.configure(1)

    async def main() -> grpc.StatusCode:
        async with channels.open_channel(f"127.0.0.1:{port}") as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            await call.read()  # streaming
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await asyncio.wait_for(call.read(), 30)
            except grpc.aio.AioRpcError as e:
                return e.code()
            raise AssertionError("the stream went on")

    try:
        assert asyncio.run(main()) is grpc.StatusCode.UNAVAILABLE
    finally:
        channels.configure(channels.KEEPALIVE_S)
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
