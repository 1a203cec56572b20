"""Hosts on one machine: network namespaces joined by veth pairs on a bridge.

``ferry up --hosts N`` runs each "host" as a network namespace with one link, ``eth0``, whose
other end is on a bridge in the root namespace; the bridge holds an address too, so the root
namespace (the launcher, a load generator) is one more host on the same /24. Processes on
different hosts talk only over their links, so a link can be cut, slowed or made lossy for one
host or between two, and its counters say what crossed it. Namespaces still share IPC: UCX must
not use shared memory between them (:data:`HOST_ENV`).

Every name carries its owner's pid (netns ``ferry-PID-hI``, bridge ``fbPID``, links
``fvPIDhI``). An owner killed with SIGKILL cannot tear down: a small reaper process, started
with the hosts, waits on a pipe from its owner and removes them all when the pipe closes, and
:func:`sweep` (run before any build) removes what is left of owners no longer running. Needs
root (CAP_NET_ADMIN), ``ip`` from iproute2 and, for the link faults, ``iptables``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNETS = ipaddress.IPv4Network("10.213.0.0/16")  # one /24 of it per running Hosts
ROOT_OCTET = 254  # the bridge's (the root namespace's) address in its /24
# Between hosts UCX goes over TCP on the host's link (shared memory would bypass the links), and
# a DEP group's gloo mesh advertises the link's address (not what the hostname resolves to).
HOST_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
_NAME = re.compile(r"^(?:ferry-(\d+)-h\d+|f[bv](\d+)(?:h\d+)?)$")
_RULE_TAG = "ferry-fault"  # the comment on every iptables rule a fault adds
_ALIAS = "ferry-hosts"  # on every link we make: a sweep never touches one without it


class HostsUnavailable(RuntimeError):
    """This machine cannot make hosts (not root, or iproute2 missing)."""


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str  # its eth0's
    link: str  # the root-namespace end of its veth pair (the bridge's port)

    @property
    def name(self) -> str:
        return f"h{self.index}"

    def exec_prefix(self) -> list[str]:
        """What runs a command inside this host (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns]


class Hosts:
    """``count`` hosts on a fresh bridge; ``up()`` builds them, ``down()`` removes every trace
    (processes inside included). A context manager: ``with Hosts(4) as hosts: ...``."""

    def __init__(self, count: int, owner: int | None = None) -> None:
        if count < 1:
            raise ValueError(f"hosts must be >= 1, not {count}")
        self.owner = owner or os.getpid()
        self.bridge = f"fb{self.owner}"
        self.count = count
        self.hosts: list[Host] = []
        self.root_address = ""
        self._reaper: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Hosts:
        self.up()
        return self

    def __exit__(self, *_: object) -> None:
        self.down()

    def up(self) -> None:
        check_can_make_hosts()
        sweep()
        self._reaper = _start_reaper(self.owner)
        net = _free_subnet()
        self.root_address = str(net[ROOT_OCTET])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "alias", _ALIAS)
            _ip("addr", "add", f"{self.root_address}/{net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                self.hosts.append(self._add_host(i, net))
        except BaseException:
            self.down()
            raise

    def _add_host(self, i: int, net: ipaddress.IPv4Network) -> Host:
        host = Host(i, f"ferry-{self.owner}-h{i}", str(net[i + 1]), f"fv{self.owner}h{i}")
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("link", "set", host.link, "alias", _ALIAS)
        _ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ["ip", "-n", host.netns]
        _run([*inside, "addr", "add", f"{host.address}/{net.prefixlen}", "dev", "eth0"])
        _run([*inside, "link", "set", "eth0", "up"])
        _run([*inside, "link", "set", "lo", "up"])
        return host

    def down(self) -> None:
        """Kill what runs inside, delete the namespaces, links and bridge. Idempotent."""
        for host in self.hosts:
            _remove_netns(host.netns)
            _remove_link(host.link)  # its peer goes with it, whoever still holds the namespace
        self.hosts = []
        _remove_link(self.bridge)
        if self._reaper is not None:  # nothing left for it: let it go
            assert self._reaper.stdin is not None
            self._reaper.stdin.close()
            self._reaper.wait()
            self._reaper = None

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)


def check_can_make_hosts() -> None:
    if os.geteuid() != 0:
        raise HostsUnavailable("--hosts needs root (CAP_NET_ADMIN) for its network namespaces")
    if shutil.which("ip") is None:
        raise HostsUnavailable("--hosts needs iproute2's `ip`: apt-get install iproute2")


# -- link faults --------------------------------------------------------------------------------


def link_counters(host: Host) -> tuple[int, int]:
    """Bytes (received, sent) by ``host`` over its link since it was made."""
    stats = Path("/sys/class/net") / host.link / "statistics"
    # the root end's tx is what the host received
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def set_link(host: Host, up: bool) -> None:
    """Unplug (or plug back) ``host``'s only link: it is cut off from every other host."""
    _ip("link", "set", host.link, "up" if up else "down")


def cut(a: Host, b: Host, loss: float = 1.0) -> None:
    """Drop packets between ``a`` and ``b`` (both ways; ``loss`` < 1: that share of them at
    random), as a partition or a lossy path between two hosts. :func:`heal` undoes it."""
    if shutil.which("iptables") is None:
        raise HostsUnavailable("link faults need iptables: apt-get install iptables")
    match = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.6f}"]
    sample = match if loss < 1.0 else []
    for chain, side in (("INPUT", "-s"), ("OUTPUT", "-d")):
        _iptables(a, "-A", chain, side, b.address, *sample, *_tag(), "-j", "DROP")


def slow(
    a: Host, peers: Sequence[Host], delay_ms: float, loss: float = 0.0
) -> list[subprocess.Popen[bytes]]:
    """Hold every packet between ``a`` and each of ``peers`` ``delay_ms`` on its way in, each
    direction (``infra/link_delay.py`` on an NFQUEUE, one per host), and drop ``loss`` of them
    at random. Held on the way in, not out: a sender's held packets would count against its
    TCP small-queue budget (netem orphans them; a queue cannot), capping a flow at a few
    packets per delay. Returns the delaying processes: :func:`heal` every host, then terminate
    them."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for host in (a, *peers):
            procs.append(_delayer(host, delay_ms))
        for host, peer in [(a, p) for p in peers] + [(p, a) for p in peers]:
            if loss > 0:
                sample = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.6f}"]
                _iptables(host, "-A", "INPUT", "-s", peer.address, *sample, *_tag(), "-j", "DROP")
            queue = ["-j", "NFQUEUE", "--queue-num", "1", "--queue-bypass"]
            _iptables(host, "-A", "INPUT", "-s", peer.address, *_tag(), *queue)
    except BaseException:
        for host in (a, *peers):
            heal(host)
        for proc in procs:
            proc.kill()
        raise
    return procs


def _delayer(host: Host, delay_ms: float) -> subprocess.Popen[bytes]:
    """link_delay on ``host``'s queue 1, once it is bound to it."""
    cmd = [sys.executable, "-P", "-m", "ferry.infra.link_delay", "--queue", "1"]
    proc = subprocess.Popen(
        [*host.exec_prefix(), *cmd, "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    if not proc.stdout.readline():  # "holding"
        raise HostsUnavailable(f"link_delay did not start on {host.name} (its error is above)")
    return proc


def heal(a: Host) -> None:
    """Remove every rule :func:`cut` or :func:`slow` added on ``a``."""
    rules = _run(["ip", "netns", "exec", a.netns, "iptables", "-S"], capture=True)
    for line in rules.splitlines():
        if _RULE_TAG in line and line.startswith("-A "):
            _iptables(a, "-D", *shlex.split(line[3:]))


def _tag() -> list[str]:
    return ["-m", "comment", "--comment", _RULE_TAG]


def _iptables(host: Host, *args: str) -> None:
    _run(["ip", "netns", "exec", host.netns, "iptables", "-w", *args])


# -- what a dead launcher left ------------------------------------------------------------------


def sweep() -> list[str]:
    """Remove the namespaces, links and bridges of owners no longer running; returns their
    names."""
    return _remove_where(_stale)


def remove_owned(owner: int) -> list[str]:
    """Remove every namespace, link and bridge of ``owner`` (and what runs inside)."""
    return _remove_where(lambda name: _owner(name) == owner)


def _remove_where(doomed: Callable[[str], bool]) -> list[str]:
    netns = [n for n in _netns_names() if doomed(n)]
    links = [n for n in _link_names() if doomed(n)]
    for name in netns:
        _remove_netns(name)
    for name in links:
        _remove_link(name)
    return netns + links


def _start_reaper(owner: int) -> subprocess.Popen[bytes]:
    """A process that removes ``owner``'s hosts once the pipe to it closes: when the owner
    calls :meth:`Hosts.down`, or dies however it dies."""
    cmd = [sys.executable, "-P", "-m", "ferry.infra.netns", "--reap", str(owner)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)


def _reap(owner: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # only the pipe ends it
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()
    remove_owned(owner)


def leftovers(owner: int) -> list[str]:
    """Namespaces and links of ``owner`` that still exist (tests: none after ``down``)."""
    return [n for n in [*_netns_names(), *_link_names()] if _owner(n) == owner]


def _owner(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1) or m.group(2)) if m else None


def _stale(name: str) -> bool:
    owner = _owner(name)
    if owner is None:
        return False
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], capture=True)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    """Our links (by their alias) in this namespace."""
    out = _run(["ip", "-o", "link", "show"], capture=True)
    # "7: fv123h0@if2: <...> ... alias ferry-hosts": the name, without the peer suffix
    return [
        line.split(": ")[1].split("@")[0]
        for line in out.splitlines()
        if ": " in line and line.rstrip().endswith(f"alias {_ALIAS}")
    ]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run(["ip", "-o", "-4", "addr", "show"], capture=True)
    taken = {
        ipaddress.IPv4Interface(word).network
        for line in used.splitlines()
        for word in line.split()
        if "/" in word and word[0].isdigit()
    }
    for net in SUBNETS.subnets(new_prefix=24):
        if not any(net.overlaps(t) for t in taken):
            return net
    raise HostsUnavailable(f"no free /24 left in {SUBNETS}")


def _remove_netns(name: str) -> None:
    pids = _run(["ip", "netns", "pids", name], capture=True, check=False)
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    # the namespace (and its end of the veth pair, which takes the other end along) goes when
    # its last process does; `ip netns del` drops the name
    _run(["ip", "netns", "del", name], check=False)


def _remove_link(name: str) -> None:
    if Path("/sys/class/net", name).exists():
        _run(["ip", "link", "del", name], check=False)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str], capture: bool = False, check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout if capture else ""


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="remove the hosts of a process once it is gone", allow_abbrev=False
    )
    parser.add_argument("--reap", type=int, required=True, metavar="OWNER_PID")
    _reap(parser.parse_args().reap)
