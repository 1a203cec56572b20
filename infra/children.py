"""Child processes that die with their parent, even when the parent is killed with SIGKILL."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

# The kernel sends SIGTERM to the child when the thread that started it exits (PR_SET_PDEATHSIG):
# start children from a long-lived thread. setpriv (util-linux) sets it just before it execs the
# command. A preexec_fn would do the same, but it makes CPython fork() rather than vfork(), and
# since grpcio 1.81 a fork of a process that has gRPC running restarts gRPC's poller in the child,
# which aborts when close_fds closes its epoll fd before the exec (grpc/grpc#43055).
_SETPRIV = shutil.which("setpriv")


def popen_dying_with_parent(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(cmd, **kwargs)`` for a child that gets SIGTERM when we exit."""
    if _SETPRIV is None:
        raise RuntimeError("setpriv (util-linux) is not installed: apt-get install util-linux")
    return subprocess.Popen([_SETPRIV, "--pdeathsig", "TERM", "--", *cmd], **kwargs)
