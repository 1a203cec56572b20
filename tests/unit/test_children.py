"""Children started by `ferry up` die with it, even when it is killed with SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.waits import wait_until

PARENT = """
import sys, grpc
from ferry.infra.children import popen_dying_with_parent
channel = grpc.insecure_channel("127.0.0.1:1")  # gRPC running in the parent, as in ferry up
child = popen_dying_with_parent([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _command_of(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:  # empty while it is between fork and exec
        return f.read()


def test_a_child_gets_sigterm_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import time\n" + PARENT], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())

    def running() -> bool:  # setpriv's own command line names the command too
        assert _alive(child), _command_of(child)
        return _command_of(child).startswith(sys.executable.encode())

    wait_until("the child runs the command alone", running, 30)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_until("the child gone with its killed parent", lambda: not _alive(child), 30)
