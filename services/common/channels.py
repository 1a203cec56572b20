"""gRPC channels from one of our services to another.

A peer that dies is restarted in seconds on the same address (`ferry up`, a k8s pod). gRPC backs
off reconnecting to an address that refused it, up to two minutes, and fails every call at once
meanwhile; so our channels retry every 0.25-1 s, and a pool gives a restarted peer process a
channel of its own.

A peer that hangs (stopped, deadlocked, or its host gone without closing the connection) fails
no call and sends nothing: its calls would wait as long as they may run. Both ends of our
connections ping (HTTP/2 keepalive) every `--keepalive` seconds; a ping not answered within as
long closes the connection, and its calls fail UNAVAILABLE, to be retried or moved as after a
crash (a server's calls are cancelled, so a worker frees the request's KV blocks). The keepalive
is one setting per process (`configure`, before any channel or server is made); servers accept
pings from peers whose keepalive is shorter than theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable
from typing import Any

import grpc

from ferry.services.common import tls
from ferry.services.common.listeners import NO_PORT_SHARING

KEEPALIVE_S = 3.0  # the default; --keepalive
MIN_KEEPALIVE_S = 1.0
_keepalive_ms = int(KEEPALIVE_S * 1000)

# what a server accepts: pings as often as any peer's keepalive, with or without calls (gRPC's
# default policy answers a client pinging more than every 5 minutes with GOAWAY "too_many_pings")
ACCEPT_PINGS: list[tuple[str, Any]] = [
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 1000) // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


def configure(keepalive_s: float) -> None:
    """This process pings each peer every ``keepalive_s`` and takes one that has not answered
    within ``keepalive_s`` for hung. Longer: a peer starved of CPU that long (a loaded host)
    is not cut; shorter: a hung peer's calls move sooner."""
    global _keepalive_ms
    _keepalive_ms = keepalive_ms(keepalive_s)


def keepalive_ms(keepalive_s: float) -> int:
    if keepalive_s < MIN_KEEPALIVE_S:
        raise ValueError(f"keepalive {keepalive_s:g} s: at least {MIN_KEEPALIVE_S:g} s")
    return round(keepalive_s * 1000)


def _pings() -> list[tuple[str, Any]]:
    return [
        ("grpc.keepalive_time_ms", _keepalive_ms),
        ("grpc.keepalive_timeout_ms", _keepalive_ms),
        # grpcio 1.85 waits this long for the ack (default a minute), not keepalive_timeout: by
        # hand, a stream from a SIGSTOPped server failed after 63 s without it, 5-6 s with it
        ("grpc.http2.ping_timeout_ms", _keepalive_ms),
        ("grpc.keepalive_permit_without_calls", 1),  # an idle peer that hangs is found too
        ("grpc.http2.max_pings_without_data", 0),  # a hung peer sends no data: keep pinging
    ]


def server_options() -> list[tuple[str, Any]]:
    """A server of ours pings its clients, accepts their pings, and shares its port with no
    other server (listeners.py)."""
    return [*_pings(), *ACCEPT_PINGS, *NO_PORT_SHARING]


def channel_options() -> list[tuple[str, Any]]:
    return [
        *_pings(),
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # gRPC shares connections (subchannels) among a process's channels to one address,
        # back-off state included: a new channel to a restarted peer would inherit the old one's
        ("grpc.use_local_subchannel_pool", 1),
    ]


def open_channel(address: str) -> grpc.aio.Channel:
    """A channel to another service of ours: mutual TLS when this process has it (tls.py)."""
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, channel_options())
    return grpc.aio.secure_channel(address, creds, channel_options())


def open_blocking_channel(address: str) -> grpc.Channel:
    """The same for a caller without an event loop (`ferry up`'s health checks)."""
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.insecure_channel(address, channel_options())
    return grpc.secure_channel(address, creds, channel_options())


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
