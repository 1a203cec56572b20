"""Delay every packet of an NFQUEUE queue by a fixed time: a slow link without ``tc netem``.

Run inside a host's network namespace (``netns.delay`` starts it and points iptables at its
queue): each packet is held and let through ``--delay-ms`` after it arrived, in order, so every
flow on the path (UCX's pooled connections, gRPC's long-lived ones) is slowed, not only new
connections as a proxy would. Needs the NetfilterQueue package (libnetfilter-queue).

    python -m ferry.infra.link_delay --queue 7 --delay-ms 25
"""

from __future__ import annotations

import argparse
import collections
import select
import signal
import sys
import time
from typing import Any


def run(queue: int, delay_s: float) -> None:
    from netfilterqueue import COPY_META, NetfilterQueue

    held: collections.deque[tuple[float, Any]] = collections.deque()

    def hold(packet: Any) -> None:
        held.append((time.monotonic() + delay_s, packet))

    nfq = NetfilterQueue()
    # the kernel keeps the packets; only their ids come up (no payload copies), into a socket
    # buffer deep enough for a link's worth of them: a full one drops packets
    nfq.bind(queue, hold, max_len=1 << 17, mode=COPY_META, sock_len=64 << 20)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("holding", flush=True)  # bound: the caller may now send packets to the queue
    fd = nfq.get_fd()
    try:
        while not stopping:
            wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.1
            if select.select([fd], [], [], wait)[0]:
                nfq.run(block=False)
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
    finally:
        for _, packet in held:  # let go of what is left before the queue goes
            packet.accept()
        nfq.unbind()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    args = p.parse_args(argv)
    run(args.queue, args.delay_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
