"""Hosts as network namespaces (infra/netns.py) and `ferry up --hosts` on them."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ferry.infra import netns
from tests.cluster import ferry_up, generate, greedy
from tests.waits import wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None,
    reason="network namespaces need root, iproute2 and iptables",
)

SERVER = "import socket,sys; s=socket.create_server((sys.argv[1], 9000)); print(flush=True)\n" + (
    "while True: s.accept()[0].close()"
)


def _connects(src: netns.Host, dst: netns.Host, timeout: float = 0.5) -> bool:
    probe = f"import socket; socket.create_connection(('{dst.address}', 9000), timeout={timeout})"
    cmd = [*src.exec_prefix(), sys.executable, "-c", probe]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _wait_gone(owner: int, timeout: float = 10.0) -> None:
    """Until nothing ``owner`` made is left (a failure lists what is)."""
    left = lambda: f"left: {netns.leftovers(owner)}"  # noqa: E731
    wait_until("its hosts removed", lambda: not netns.leftovers(owner), timeout, explain=left)


def test_hosts_talk_over_their_links_and_a_cut_parts_two_of_them() -> None:
    with netns.Hosts(3) as hosts:
        a, b, c = hosts
        server = subprocess.Popen(
            [*b.exec_prefix(), sys.executable, "-c", SERVER, b.address], stdout=subprocess.PIPE
        )
        assert server.stdout is not None
        server.stdout.readline()  # listening
        sent_before = netns.link_counters(a)[1]
        assert _connects(a, b) and _connects(c, b)
        assert netns.link_counters(a)[1] > sent_before  # a's connection crossed its link

        netns.cut(a, b)
        assert not _connects(a, b)
        assert _connects(c, b)  # only a <-> b is cut
        netns.heal(a)
        assert _connects(a, b)

        netns.set_link(b, up=False)
        assert not _connects(c, b)
        netns.set_link(b, up=True)
        assert _connects(c, b, timeout=5.0)
    assert server.wait(10) == -signal.SIGKILL  # down() killed what ran inside
    _wait_gone(os.getpid())


def _connect_s(src: netns.Host, dst: netns.Host) -> float:
    """Seconds a TCP handshake from ``src`` to ``dst`` takes (one round trip)."""
    probe = (
        "import socket, time; t = time.monotonic(); "
        f"socket.create_connection(('{dst.address}', 9000), timeout=5); "
        "print(time.monotonic() - t)"
    )
    cmd = [*src.exec_prefix(), sys.executable, "-c", probe]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def test_a_slow_path_holds_each_packet_both_ways() -> None:
    with netns.Hosts(4) as hosts:
        a, b, c, d = hosts
        servers = [
            subprocess.Popen(
                [*h.exec_prefix(), sys.executable, "-c", SERVER, h.address],
                stdout=subprocess.PIPE,
            )
            for h in (b, c)
        ]
        for server in servers:
            assert server.stdout is not None
            server.stdout.readline()
        delayers = netns.slow(a, [b, c], delay_ms=100)  # one queue per host, for both peers
        try:
            # the SYN held on its way into b (or c), the SYN-ACK on its way into a
            assert _connect_s(a, b) >= 0.2 and _connect_s(a, c) >= 0.2
            assert _connect_s(d, b) < 0.2  # only a's paths are slow
        finally:
            for host in (a, b, c):
                netns.heal(host)
            for proc in delayers:
                proc.terminate()
                assert proc.wait(10) == 0
        assert _connect_s(a, b) < 0.2


def test_hosts_of_an_owner_killed_with_sigkill_are_removed() -> None:
    script = "from ferry.infra import netns; netns.Hosts(2).up(); print(flush=True); input()"
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert owner.stdout is not None
    owner.stdout.readline()
    assert len(netns.leftovers(owner.pid)) == 5  # 2 namespaces, 2 links, the bridge
    owner.kill()
    owner.wait()
    _wait_gone(owner.pid)  # its reaper removed them


def test_ferry_up_on_hosts_moves_kv_over_the_prefill_hosts_link() -> None:
    with ferry_up("", "--hosts", "4", "--enforce-eager", cluster="hosts") as c:
        owner = c.proc.pid
        hosts = {h.address: h for h in _hosts_of(owner)}
        workers = {v.record.role: v.record.address.rsplit(":", 1)[0] for v in c.views()}
        prefill, decode = hosts[workers["prefill"]], hosts[workers["decode"]]
        assert len({c.scheduler.rsplit(":", 1)[0], prefill.address, decode.address}) == 3

        sent = netns.link_counters(prefill)[1]
        prompt = [3 + i % 250 for i in range(2000)]
        result = asyncio.run(generate(c.scheduler, prompt, greedy(8)))
        assert len(result.token_ids) == 8 and result.code is None
        # its KV went prefill -> decode over the link: 2,000 tokens of tiny's 1,280 bytes each
        assert netns.link_counters(prefill)[1] - sent > 2000 * 1280
        c.wait_for("blocks free", c.all_blocks_free, timeout=30)
    _wait_gone(owner)


def _hosts_of(owner: int) -> list[netns.Host]:
    """The hosts `ferry up` (pid ``owner``) made, read back from the machine."""
    hosts = []
    for name in sorted(n for n in netns.leftovers(owner) if n.startswith("ferry-")):
        i = int(name.rsplit("-h", 1)[1])
        out = subprocess.run(
            ["ip", "-n", name, "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True
        ).stdout
        address = out.split("inet ")[1].split("/")[0]
        hosts.append(netns.Host(i, name, address, f"fv{owner}h{i}"))
    return hosts


def test_a_build_sweeps_what_dead_owners_left() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"ferry-{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "link", "add", f"fb{dead.pid}", "type", "bridge"], check=True)
    subprocess.run(["ip", "link", "set", f"fb{dead.pid}", "alias", "ferry-hosts"], check=True)
    unmarked = f"fv{dead.pid}h9"  # a name like ours without our alias: not ours to remove
    subprocess.run(["ip", "link", "add", unmarked, "type", "bridge"], check=True)
    try:
        with netns.Hosts(1):
            assert netns.leftovers(dead.pid) == []
            assert Path("/sys/class/net", unmarked).exists()
    finally:
        netns.remove_owned(dead.pid)
        subprocess.run(["ip", "link", "del", unmarked], check=False)
