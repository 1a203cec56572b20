"""Our threads as the OS sees them: their names (``top -H``, ``/proc/PID/task/TID/comm``;
Python 3.11's ``threading`` names a thread for Python only, so profiles from outside see every
thread as "python") and their CPU priority."""

from __future__ import annotations

import ctypes
import os
import sys

_PR_SET_NAME = 15
_MAX_BYTES = 15  # the kernel's limit, without the terminating NUL


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) in the OS; Linux only."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:_MAX_BYTES], 0, 0, 0)


def lower_priority(nice: int) -> None:
    """Lower the CPU priority of every thread of this process by ``nice`` (Linux keeps one per
    thread; threads started later take their starter's)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, now + nice))
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            continue
