"""Thread names and priorities as the OS sees them (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ferry.services.common.os_thread import lower_priority, name_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")


def test_a_named_thread_shows_its_name_to_the_os() -> None:
    seen: list[str] = []

    def run() -> None:
        name_this_thread("ferry-engine-and-more")  # cut to the kernel's 15 bytes
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == ["ferry-engine-an"]


def test_lower_priority_lowers_every_thread_and_those_started_after() -> None:
    script = """
import os, threading
from ferry.services.common.os_thread import lower_priority
gate = threading.Event()
before = threading.Thread(target=gate.wait)
before.start()
lower_priority(5)
seen = {}
def run():
    seen["after"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
after = threading.Thread(target=run)
after.start()
after.join()
seen["before"] = os.getpriority(os.PRIO_PROCESS, before.native_id)
seen["main"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
gate.set()
print(sorted(seen.items()))
"""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    want = min(19, base + 5)
    assert run.stdout.strip() == str([("after", want), ("before", want), ("main", want)])
    lower_priority(0)  # nothing to do
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
