"""Children started by `ferry up` die with it, even when it is killed with SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

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
    deadline = time.monotonic() + 30
    # setpriv's own command line names the command too: wait until it is the command alone
    while not _command_of(child).startswith(sys.executable.encode()):
        assert _alive(child) and time.monotonic() < deadline, _command_of(child)
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
