"""gRPC channels from one of our services to another.

A peer that dies is restarted in seconds on the same address (`ferry up`, a k8s pod). gRPC backs
off reconnecting to an address that refused it, up to two minutes, and fails every call at once
meanwhile; so our channels retry every 0.25-1 s, and a pool gives a restarted peer process a
channel of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable

import grpc

OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # gRPC shares connections (subchannels) among a process's channels to one address, back-off
    # state included: a new channel to a restarted peer would inherit the old one's
    ("grpc.use_local_subchannel_pool", 1),
]


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, OPTIONS)


class ChannelPool:
    """One channel per peer process. ``process`` names the process at ``address`` (e.g. its pid
    and start time from its registry record): another one there gets a new channel, and the old
    one is closed (its process is gone, and its calls with it)."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[Hashable, grpc.aio.Channel]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str, process: Hashable = None) -> grpc.aio.Channel:
        known = self._channels.get(address)
        if known is not None and known[0] == process:
            return known[1]
        if known is not None:
            task = asyncio.get_running_loop().create_task(known[1].close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        channel = open_channel(address)
        self._channels[address] = (process, channel)
        return channel

    def __len__(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        for _, channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._channels.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
