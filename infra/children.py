"""Child processes that die with their parent, even when the parent is killed with SIGKILL."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for Popen: the kernel sends SIGTERM to the child when its parent exits.

    (Strictly, when the thread that forked it exits: start children from a long-lived thread.)
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
