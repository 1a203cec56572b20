"""``ferry up``: a whole local cluster as child processes.

Starts a private redis-server (unless a Redis URL is given), then the prefill, decode and
aggregated workers, the scheduler(s) and (when there is a DEP group) the EPLB controller, each as
``ferry serve ROLE``; waits until every one answers its gRPC
health check; prints the endpoints; and on Ctrl-C / SIGTERM stops them all (scheduler first,
redis last). Children die with the launcher even if it is killed (PR_SET_PDEATHSIG).

A child that dies is reported and the others go on serving; by the restart policy
(``infra/restarts.py``, ``--restart``) it is started again on the same ports after a back-off
(the private redis-server too: it comes back empty and the services re-register). A
DEP group restarts as one unit: a rank's death fails its peers, so the survivors are stopped and
every rank starts over on a new master (which also names a new group in Redis). The exit code is
non-zero when any child died on its own.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferry.infra import netns
from ferry.infra.children import popen_dying_with_parent
from ferry.infra.ports import free_port, listens, reserve
from ferry.infra.redis_server import redis_answers, redis_command, start_redis
from ferry.infra.restarts import Backoff, RestartPolicy
from ferry.protos import scheduler_pb2, scheduler_pb2_grpc
from ferry.services.common import tls
from ferry.services.common.channels import open_blocking_channel
from ferry.services.common.listeners import USAGE_ERROR, PortInUse, check_free
from ferry.services.common.tls import TlsFiles

WORKER_ROLES = ("prefill", "decode", "aggregated")
# -P: the working directory is not put on a child's sys.path; a checkout's top-level folders
# (kernels/, services/, ...) would otherwise shadow other distributions' modules of that name.
SERVE = (sys.executable, "-P", "-m", "ferry.infra.cli", "serve")
STOP_GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL


@dataclass
class Child:
    name: str
    role: str
    address: str  # gRPC host:port (the gateway's: its HTTP host:port)
    metrics_port: int
    proc: subprocess.Popen[bytes]
    cmd: list[str]  # what started it, and starts it again
    unit: str  # what it restarts with: its own name, or its DEP group's
    env: dict[str, str] | None = None  # variables of its own (secrets: never in its argv)


@dataclass
class Unit:
    """Children that live and restart together: one service, or every rank of a DEP group."""

    name: str
    backoff: Backoff
    state: str = "serving"  # serving | stopping | waiting | starting | down (for good)
    started: float = field(default_factory=time.monotonic)
    deadline: float = 0.0  # stopping: SIGKILL after; waiting: start again at


@dataclass
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    prefill_dep: int = 1  # > 1: also one prefill DEP group of this many ranks
    decode_dep: int = 1
    aggregated: int = 0  # workers that prefill and decode in one engine
    schedulers: int = 1  # replicas; the gateway spreads requests over them
    host: str = "127.0.0.1"
    hosts: int = 0  # > 0: run on this many network-namespace hosts (infra/netns.py)
    scheduler_port: int = 50052  # the first scheduler's; 0: any free port (others: any)
    gateway: bool = True  # the OpenAI REST API and the public gRPC API (False: none)
    gateway_port: int = 8000  # the OpenAI REST API; 0: any free port
    grpc_port: int = 50051  # the gateway's public gRPC API; 0: any free port
    redis_url: str = ""  # "": start a private redis-server
    cluster: str = "default"
    startup_timeout_s: float = 180.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    serve_args: dict[str, list[str]] = field(default_factory=dict)  # role -> extra flags
    # role -> environment variables of its own: secrets (FERRY_API_KEY) go here, not in argv,
    # which any user of the host can read
    serve_env: dict[str, dict[str, str]] = field(default_factory=dict)
    tls: TlsFiles = field(default_factory=TlsFiles)  # every child's --tls-*, and ours
    throwaway_tls: bool = False  # --tls: make a CA and certificates for this run (tls above)


@dataclass(frozen=True)
class Where:
    """Where a child runs: the address it binds, and what runs it there."""

    address: str
    prefix: tuple[str, ...] = ()  # e.g. ip netns exec NS
    env: dict[str, str] = field(default_factory=dict)


class Placement:
    """``ferry up --hosts N``: redis on host 0, the control plane (gateway, schedulers, EPLB
    controller) on host 1, the workers (each DEP rank too) one after another over the rest; with
    fewer hosts than that, the later roles share the last one. Ports are picked per host from
    ``FIRST_PORT`` up, past the ``fixed`` ones: a host is a fresh namespace, nothing else binds
    there."""

    FIRST_PORT = 40000

    def __init__(self, count: int, fixed: tuple[int, ...] = ()) -> None:
        self.hosts = netns.Hosts(count)
        self.fixed = set(fixed)
        self._next_port: dict[str, int] = {}
        self._workers = 0

    def next(self, role: str) -> Where:
        n = self.hosts.count
        if role == "redis":
            i = 0
        elif role in WORKER_ROLES:
            first = min(2, n - 1)
            i = first + self._workers % (n - first)
            self._workers += 1
        else:
            i = min(1, n - 1)
        host = self.hosts[i]
        return Where(host.address, tuple(host.exec_prefix()), dict(netns.HOST_ENV))

    def port(self, address: str) -> int:
        port = self._next_port.get(address, self.FIRST_PORT)
        while port in self.fixed:
            port += 1
        self._next_port[address] = port + 1
        return port

    def describe(self) -> str:
        return ", ".join(f"{h.name} {h.address} ({h.netns})" for h in self.hosts) + (
            f"; this one {self.hosts.root_address}"
        )


class StartupFailed(RuntimeError):
    """The cluster did not come up; ``code`` is `ferry up`'s exit status (2: a child could not
    run as configured, e.g. a taken port)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _exited(child: Child) -> StartupFailed:
    code = child.proc.returncode
    return StartupFailed(
        f"{child.name} exited with code {code} during start-up (its log is above)",
        USAGE_ERROR if code == USAGE_ERROR else 1,
    )


class Launcher:
    def __init__(self, spec: ClusterSpec) -> None:
        if spec.gateway:  # port 0: any free one, as for every other listener
            spec = dataclasses.replace(
                spec,
                gateway_port=spec.gateway_port or free_port(spec.host),
                grpc_port=spec.grpc_port or free_port(spec.host),
            )
        self.spec = spec
        fixed = (spec.scheduler_port, spec.gateway_port, spec.grpc_port)
        self.net = Placement(spec.hosts, fixed) if spec.hosts else None
        # its fixed ports are bound late (the gateway's once the workers serve): no child may
        # be given one meanwhile
        reserve(spec.scheduler_port, spec.gateway_port, spec.grpc_port)
        self.children: list[Child] = []
        self.units: dict[str, Unit] = {}
        self.redis_url = spec.redis_url
        self._stop = threading.Event()

    def start(self) -> None:
        s = self.spec
        fixed = [("the first scheduler", s.scheduler_port, "--scheduler-port")]
        if s.gateway:
            fixed += [("the gateway", s.gateway_port, "--port")]
            fixed += [("the gateway's gRPC API", s.grpc_port, "--grpc-port")]
        if self.net:  # fresh hosts: nothing holds a port on them yet
            self.net.hosts.up()
            self._say(f"hosts: {self.net.describe()}")
        else:
            for what, port, flag in fixed:  # taken: say so before starting anything
                check_free(s.host, port, what, flag)
        if not self.redis_url:  # a private one, supervised like the services
            self._start_redis()
        for role, count, dep in (
            ("prefill", s.prefill, s.prefill_dep),
            ("decode", s.decode, s.decode_dep),
            ("aggregated", s.aggregated, 1),
        ):
            if dep > 1:  # one DEP group of `dep` ranks, besides `count` independent workers
                ranks = [self._where(role) for _ in range(dep)]
                master = f"{ranks[0].address}:{self._port(ranks[0].address)}"
                for r, place in enumerate(ranks):
                    self._spawn(
                        role,
                        f"{role}-r{r}",
                        place=place,
                        unit=f"{role}-dep",
                        extra=[
                            "--dep-size",
                            str(dep),
                            "--dep-rank",
                            str(r),
                            "--dep-master",
                            master,
                        ],
                    )
            for i in range(count):
                self._spawn(role, f"{role}-{i}")
        for i in range(s.schedulers):
            self._spawn("scheduler", f"scheduler-{i}", port=s.scheduler_port if i == 0 else 0)
        if max(s.prefill_dep, s.decode_dep) > 1:  # a DEP group: balance its experts live
            self._spawn("eplb", "eplb-0")
        self._say(f"started {', '.join(c.name for c in self.children)}; the workers load the model")
        self._wait_healthy()
        if s.gateway:
            self._spawn_gateway()
            gateway = self._by_role("gateway")[0]
            self._say(f"gateway is up ({tls.http_scheme()}://{gateway.address})")

    def _start_redis(self) -> None:
        place = self._where("redis")
        port = self._port(place.address)
        cmd = [*place.prefix, *redis_command(port, place.address)]
        proc = start_redis(port, place.address, cmd=cmd)
        address = f"{place.address}:{port}"
        self._add(Child("redis", "redis", address, 0, proc, cmd, "redis"))
        self.redis_url = f"redis://{address}/0"

    def _where(self, role: str) -> Where:
        """The host a new child of ``role`` runs on: this one, or the next of --hosts'."""
        return self.net.next(role) if self.net else Where(self.spec.host)

    def _port(self, address: str) -> int:
        return self.net.port(address) if self.net else free_port(address)

    def _by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def _spawn(
        self,
        role: str,
        name: str,
        port: int = 0,
        unit: str = "",
        extra: list[str] | None = None,
        place: Where | None = None,
    ) -> None:
        place = place or self._where(role)
        port = port or self._port(place.address)
        metrics_port = self._port(place.address)
        cmd = [
            *place.prefix,
            *SERVE,
            role,
            "--worker-id",
            name,
            "--host",
            place.address,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--redis-url",
            self.redis_url,
            "--cluster",
            self.spec.cluster,
            *self.spec.tls.flags(),
            *self.spec.serve_args.get(role, []),
            *(extra or []),
        ]
        env = {**self.spec.serve_env.get(role, {}), **place.env} or None
        address = f"{place.address}:{port}"
        self._add(
            Child(name, role, address, metrics_port, _popen(cmd, env=env), cmd, unit or name, env)
        )

    def _add(self, child: Child) -> None:
        self.children.append(child)
        if child.unit not in self.units:
            self.units[child.unit] = Unit(child.unit, Backoff(self.spec.restart))

    def _spawn_gateway(self) -> None:
        s = self.spec
        schedulers = ",".join(c.address for c in self.children if c.role == "scheduler")
        place = self._where("gateway")
        cmd = [
            *place.prefix,
            *SERVE,
            "gateway",
            "--host",
            place.address,
            "--port",
            str(s.gateway_port),
            "--grpc-port",
            str(s.grpc_port),
            "--scheduler",
            schedulers,
            *s.tls.flags(),
            *s.serve_args.get("gateway", []),
        ]
        env = {**s.serve_env.get("gateway", {}), **place.env} or None
        proc = _popen(cmd, env=env)
        address = f"{place.address}:{s.gateway_port}"
        child = Child("gateway", "gateway", address, s.gateway_port, proc, cmd, "gateway", env)
        self._add(child)
        url = f"{tls.http_scheme()}://{child.address}/health"
        deadline = time.monotonic() + s.startup_timeout_s
        while not (_http_ok(url) and listens(proc.pid, s.gateway_port)):
            if proc.poll() is not None:
                raise _exited(child)
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway not healthy at {url}")
            time.sleep(0.2)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for child in (c for c in self.children if c.role != "redis"):  # redis answered already
            port = int(child.address.rsplit(":", 1)[1])
            with open_blocking_channel(child.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                # SERVING, from our child: not another process that holds the port
                while not (_serving(stub) and listens(child.proc.pid, port)):
                    if child.proc.poll() is not None:
                        raise _exited(child)
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{child.name} not healthy at {child.address} after "
                            f"{self.spec.startup_timeout_s:.0f}s"
                        )
                    time.sleep(0.2)
            self._say(f"{child.name} is up")
        self._wait_scheduler_sees_workers(deadline)

    def _wait_scheduler_sees_workers(self, deadline: float) -> None:
        """Ready means servable: the scheduler's view holds every worker we started."""
        for sched in (c for c in self.children if c.role == "scheduler"):
            with open_blocking_channel(sched.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                ours = {c.name: c.proc.pid for c in self.children if c.role in WORKER_ROLES}
                seen: dict[str, int] = {}  # worker id -> the pid registered under it
                while any(seen.get(w) != pid for w, pid in ours.items()):  # our children's
                    if time.monotonic() > deadline:
                        missing = sorted(w for w, pid in ours.items() if seen.get(w) != pid)
                        raise RuntimeError(f"{sched.name} does not see {missing}")
                    reply = stub.ClusterStatus(scheduler_pb2.ClusterStatusRequest(), timeout=5)
                    seen = {w.info.worker_id: w.info.pid for w in reply.workers}
                    time.sleep(0.1)

    def describe(self) -> str:
        private = any(c.role == "redis" for c in self.children)
        lines = [f"  redis      {self.redis_url}" + ("  (private)" if private else "")]
        if self.net:
            lines.append(f"  hosts      {self.net.describe()}")
        if self.spec.tls.on:
            lines.append(
                f"  tls        CA {self.spec.tls.ca} (its clients trust it; mutual inside)"
            )
        for c in (c for c in self.children if c.role != "redis"):
            if c.role == "gateway":
                host = c.address.rsplit(":", 1)[0]
                lines.append(
                    f"  {c.name:<12} {tls.http_scheme()}://{c.address}/v1  (OpenAI API; /health, "
                    f"/metrics), grpc {host}:{self.spec.grpc_port} (ferry.v1.Ferry)"
                )
                continue
            lines.append(
                f"  {c.name:<12} grpc {c.address:<22} metrics http://"
                f"{c.address.rsplit(':', 1)[0]}:{c.metrics_port}/metrics"
            )
        return "\n".join(lines)

    def wait(self) -> int:
        """Serve until asked to stop; returns 1 if any child died on its own, else 0.

        A dead child is reported, the rest keep serving (the scheduler routes around a dead
        worker, as it would in a real deployment), and the restart policy may start it again.
        The cluster stops when redis is gone, or when, among the children not dead for good, no
        scheduler or gateway is left, or no aggregated worker and no prefill + decode pair:
        nothing could be served.
        """
        reported: set[int] = set()  # pids
        while not self._stop.wait(0.5):
            for c in self.children:
                if c.proc.poll() is not None and c.proc.pid not in reported:
                    reported.add(c.proc.pid)
                    self._say(f"{c.name} exited with code {c.proc.returncode}")
            for unit in self.units.values():
                self._tend(unit)
            if fatal := self._fatal():
                self._say(f"{fatal}; stopping the cluster")
                break
        return 1 if reported or self._fatal() else 0

    def _tend(self, unit: Unit) -> None:
        """One step of ``unit``'s life: notice a death, stop the rest of its group, wait out the
        back-off, start it again, see it serve."""
        members = [c for c in self.children if c.unit == unit.name]
        if unit.state in ("serving", "starting"):
            self._watch(unit, members)
        if unit.state == "stopping":
            self._reap(unit, members)
        if unit.state == "waiting" and time.monotonic() >= unit.deadline:
            self._restart(unit, members)

    def _watch(self, unit: Unit, members: list[Child]) -> None:
        """A running unit: is it serving (again), or did a member die so that it restarts?"""
        codes = [c.proc.poll() for c in members]
        if all(code is None for code in codes):
            if unit.state == "starting" and all(_healthy(c) for c in members):
                unit.state = "serving"
                self._say(f"{unit.name} is serving again")
            return
        if not any(code is not None and self.spec.restart.wants(code) for code in codes):
            if all(code is not None for code in codes):  # stopped cleanly, or never restart
                unit.state = "down"
                self._say(f"{unit.name} stays down (--restart {self.spec.restart.mode})")
            return
        for c in members:  # a DEP group cannot take a rank back: it starts over
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        unit.state, unit.deadline = "stopping", time.monotonic() + STOP_GRACE_S

    def _reap(self, unit: Unit, members: list[Child]) -> None:
        """A unit to restart: once every member has exited, wait out its back-off (or give up)."""
        now = time.monotonic()
        if any(c.proc.poll() is None for c in members):
            if now > unit.deadline:
                for c in members:
                    if c.proc.poll() is None:
                        c.proc.kill()
            return
        delay = unit.backoff.after_exit(now - unit.started)
        if delay is None:
            self._say(
                f"{unit.name} failed {unit.backoff.quick_failures} times in a row soon "
                "after starting; not restarting it"
            )
            unit.state = "down"
            return
        self._say(f"restarting {unit.name} in {delay:.0f} s")
        unit.state, unit.deadline = "waiting", now + delay

    def _restart(self, unit: Unit, members: list[Child]) -> None:
        """Start ``members`` again on their ports; a DEP group on a new master."""
        if any("--dep-master" in c.cmd for c in members):
            host = members[0].address.rsplit(":", 1)[0]  # rank 0's
            master = f"{host}:{self._port(host)}"
            for c in members:
                c.cmd = _with_flag(c.cmd, "--dep-master", master)
        for c in members:
            c.proc = _popen(c.cmd, quiet=c.role == "redis", env=c.env)
        unit.state, unit.started = "starting", time.monotonic()
        pids = ", ".join(f"{c.name} pid {c.proc.pid}" for c in members)
        self._say(f"restarted {unit.name} ({pids})")

    @staticmethod
    def _say(message: str) -> None:
        print(f"ferry up: {message}", file=sys.stderr, flush=True)

    def _fatal(self) -> str:
        if self._gone("redis"):
            return "redis-server is gone"
        for role in ("gateway", "scheduler", *WORKER_ROLES):
            if self._gone(role) and (role in ("gateway", "scheduler") or not self._can_serve()):
                return f"no {role} is left"
        return ""

    def _down(self, child: Child) -> bool:
        """Dead, and not to be started again. (Its unit's state, as the last look at it found
        it: a death since then is ``_tend``'s to judge on the next look.)"""
        return self.units[child.unit].state == "down"

    def _gone(self, role: str) -> bool:
        """Children of ``role`` were started and every one is down for good."""
        children = [c for c in self.children if c.role == role]
        return bool(children) and all(self._down(c) for c in children)

    def _can_serve(self) -> bool:
        """An aggregated worker, or a prefill and a decode worker, is running or restarting."""

        def alive(role: str) -> bool:
            return any(not self._down(c) for c in self.children if c.role == role)

        return alive("aggregated") or (alive("prefill") and alive("decode"))

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the gateway, the scheduler, the workers, then redis; SIGKILL what does not
        exit."""
        for group in (["gateway"], ["scheduler", "eplb"], WORKER_ROLES, ["redis"]):
            procs = [c.proc for c in self.children if c.role in group and c.proc.poll() is None]
            _terminate(procs, grace_s)
        if self.net:
            self.net.hosts.down()


def _terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"ferry up: pid {p.pid} did not stop within {grace_s:.0f}s; killing it",
                file=sys.stderr,
                flush=True,
            )
            p.kill()
            p.wait()


def _popen(
    cmd: list[str], quiet: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A child that dies with us; ``quiet``: without stdout (our own stdout is the endpoints);
    ``env``: variables on top of ours."""
    stdout = subprocess.DEVNULL if quiet else None
    full = {**os.environ, **env} if env else None
    return popen_dying_with_parent(cmd, stdout=stdout, env=full)


def _with_flag(cmd: list[str], flag: str, value: str) -> list[str]:
    """``cmd`` with the value after ``flag`` replaced."""
    i = cmd.index(flag)
    return [*cmd[: i + 1], value, *cmd[i + 2 :]]


def _healthy(child: Child) -> bool:
    """One quick look: the child answers its health check (the gateway: GET /health; redis:
    PING), and it is the child that holds its port."""
    host, port_text = child.address.rsplit(":", 1)
    port = int(port_text)
    if child.role == "redis":
        return redis_answers(host, port)
    if child.role == "gateway":
        ok = _http_ok(f"{tls.http_scheme()}://{child.address}/health", timeout=0.5)
    else:
        with open_blocking_channel(child.address) as channel:
            ok = _serving(health_pb2_grpc.HealthStub(channel), timeout=0.5)
    return ok and listens(child.proc.pid, port)  # ours, not a process that took its port


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=tls.client_ssl_context()) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def _serving(stub: health_pb2_grpc.HealthStub, timeout: float = 1.0) -> bool:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def run(spec: ClusterSpec) -> int:
    if not spec.throwaway_tls:
        return _run(spec)
    # the user's alone (0700), and gone with the cluster
    with tempfile.TemporaryDirectory(prefix="ferry-tls-") as d:
        from ferry.infra.certs import throwaway

        return _run(dataclasses.replace(spec, tls=throwaway(Path(d), spec.host)))


def _run(spec: ClusterSpec) -> int:
    tls.configure(spec.tls)  # our health checks show the cluster's certificate too
    launcher = Launcher(spec)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    signal.signal(signal.SIGINT, launcher.request_stop)
    code = 1
    try:
        launcher.start()
        print(
            f"ferry up: ready (pid {os.getpid()}); Ctrl-C stops the cluster\n{launcher.describe()}",
            flush=True,
        )
        code = launcher.wait()
    except PortInUse as e:
        print(f"ferry up: {e}", file=sys.stderr, flush=True)
        code = USAGE_ERROR
    except RuntimeError as e:
        print(f"ferry up: {e}", file=sys.stderr, flush=True)
        code = e.code if isinstance(e, StartupFailed) else 1
    finally:
        launcher.stop()
    return code
