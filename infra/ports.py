"""Ports picked for a child process that binds them a moment later (``ferry up``, tests).

Ports come from below the kernel's ephemeral range when there is room for them. Every outgoing
connection and every ``bind(port 0)`` on the machine takes its port from that range, so a port
picked inside it can be taken between the pick and the child's bind: seen once, when a DEP
rank's gloo start-up opened many connections while the rank's metrics port waited. Below the
range only another explicit pick can take it, and this process never hands out one twice.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from pathlib import Path

PICK_FLOOR = 20000  # below this, well-known services (databases, dev servers) often listen
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port``: the process answering
    there is that one, not another that took the port. True where /proc cannot tell."""
    if not Path("/proc/net/tcp").exists():
        return True
    # its own network namespace's tables (``ferry up --hosts`` runs children in others)
    tables = [Path(f"/proc/{pid}/net/tcp"), Path(f"/proc/{pid}/net/tcp6")]
    inodes = set()
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                f = line.split()  # sl local_address rem_address st ... inode
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
    return False


def reserve(*ports: int) -> None:
    """Never hand out ``ports``: they are given to a process that binds them later (`ferry up`'s
    gateway, bound only once the workers serve)."""
    with _lock:
        _given.update(p for p in ports if p > 0)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, not handed out before by this process."""
    low, _ = ephemeral_range()
    with _lock:
        if low - PICK_FLOOR >= 1000:
            for _ in range(100):
                port = random.randrange(PICK_FLOOR, low)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        while True:  # no room below the range (or all tried were busy): the kernel's pick
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _given:
                _given.add(port)
                return port
