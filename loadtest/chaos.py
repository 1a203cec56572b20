"""Faults across hosts: a steady agentic load on a `ferry up --hosts` cluster, one fault at a time,
and what each fault cost the clients.

The cluster runs as hosts (network namespaces on a bridge, ``infra/netns.py``): redis on h0, the
gateway, the scheduler and the EPLB controller on h1, each worker on a host of its own, UCX over
TCP on the links. The launcher's supervisor restarts what dies (``--restart on-failure``), the
scheduler and the gateway move broken streams (``--migration-limit``).

The load is AgentX-like sessions (``agentx.py``: a shared system prompt, growing contexts,
greedy, ``ignore_eos``) sent by ``--concurrency`` clients to the gateway's public gRPC API. One
undisturbed round over the whole pool first records every request's tokens and duration; then
for each fault the clients cycle over the pool again while the fault happens, and every request
that completes must give exactly its undisturbed tokens. A request is hung when it has not ended
``--hang-after`` seconds after its undisturbed duration (the client gives up on it then).

Per fault, in ``--out`` (``{"hosts": N, "faults": [...]}``): requests sent; completed; failed
by the gRPC status the client saw; hung; KV blocks still held on any worker once the load has
drained and the cluster settled (leases included: an exported prompt holds its blocks);
completed outputs that differ from the undisturbed round; and seconds from the fault to the
first request sent after it that completes.

    python loadtest/chaos.py --short   # kill -9, SIGSTOP, Redis restart, a partition: ~5 min
    python loadtest/chaos.py           # every fault kind, a DEP group and its EPLB controller
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from agentx import WorkloadConfig, generate_sessions, render_prompt
from harness import WORKER_ROLES, launched, record, worker_views, write_result

from ferry.infra import netns
from ferry.infra.launcher import Child, ClusterSpec, Launcher
from ferry.protos import common_pb2, ferry_pb2, ferry_pb2_grpc
from ferry.services.common.cluster_state import WorkerView

STOP_S = 20.0  # SIGSTOP lasts this long
LEAD_S = 3.0  # load before the fault
TAIL_S = 3.0  # load after the cluster recovered
RECOVERY_LIMIT_S = 180.0  # a fault the cluster has not recovered from by then is reported so
SLOW_DELAY_MS, SLOW_LOSS = 50.0, 0.01  # the slow link: each direction, as netem's delay and loss
RETRY_AFTER_S = 0.5  # a client whose request failed waits this long, as an agent would


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str  # kill | stop | redis | partition | slow | disconnects
    target: str = ""  # the child a kill or a stop hits
    hold_s: float = 0.0  # a stop's, a partition's or a slow link's length


def faults(short: bool) -> list[Fault]:
    if short:
        return [
            Fault("kill -9 decode-0", "kill", "decode-0"),
            Fault("SIGSTOP prefill-0 20 s", "stop", "prefill-0", STOP_S),
            Fault("redis killed and restarted", "redis", "redis"),
            Fault("prefill-decode partition 5 s", "partition", hold_s=5.0),
        ]
    services = ["gateway", "scheduler-0", "prefill-0", "decode-0", "decode-r1", "eplb-0"]
    return [
        *(Fault(f"kill -9 {s}", "kill", s) for s in services),
        *(Fault(f"SIGSTOP {s} 20 s", "stop", s, STOP_S) for s in services),
        Fault("redis killed and restarted", "redis", "redis"),
        Fault("prefill-decode link down 5 s", "partition", hold_s=5.0),
        Fault("prefill-decode partition 60 s", "partition", hold_s=60.0),
        Fault("prefill-decode 50 ms delay, 1% loss, 30 s", "slow", hold_s=30.0),
        Fault("client disconnect storm", "disconnects"),
    ]


# -- the load -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    id: str
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    id: str
    started: float
    ended: float
    status: str  # OK, a gRPC status name, HUNG or CANCELLED (the client's own)
    tokens: list[int] = field(default_factory=list)
    detail: str = ""


def job_pool(sessions: int, max_context: int, seed: int) -> list[list[Job]]:
    """Sessions of AgentX-like requests, each session's in the order its agent sends them."""
    config = WorkloadConfig(seed=seed, max_context_tokens=max_context)
    pool = []
    for s in generate_sessions(config, 0, sessions):
        jobs = [Job(r.id, render_prompt(messages), r.max_tokens) for r, messages in s.play()]
        pool.append(jobs)
    return pool


class Client:
    """Requests to the gateway's public gRPC API over one channel that reconnects quickly."""

    OPTIONS = (
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    )

    def __init__(self, address: str, model: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=self.OPTIONS)
        self.stub = ferry_pb2_grpc.FerryStub(self.channel)
        self.model = model

    async def send(self, job: Job, deadline_s: float, cancel_after: int = -1) -> Outcome:
        """``job`` to its end; HUNG after ``deadline_s``; ``cancel_after`` >= 0: the client
        hangs up after that many chunks."""
        params = common_pb2.SamplingParams(
            temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True
        )
        req = ferry_pb2.TextGenerateRequest(
            model=self.model, prompt=job.prompt, sampling_params=params
        )
        out = Outcome(job.id, time.monotonic(), 0.0, "OK")
        call = self.stub.Generate(req, wait_for_ready=False)

        async def read() -> None:
            chunks = 0
            async for chunk in call:
                out.tokens += chunk.token_ids
                chunks += 1
                if chunks == cancel_after:
                    call.cancel()
                    out.status = "CANCELLED"
                    return

        try:
            await asyncio.wait_for(read(), deadline_s)
        except TimeoutError:
            out.status = "HUNG"
        except grpc.aio.AioRpcError as e:
            out.status, out.detail = e.code().name, e.details() or ""
        except asyncio.CancelledError:
            if out.status != "CANCELLED":
                raise
        out.ended = time.monotonic()
        return out

    async def close(self) -> None:
        await self.channel.close()


async def undisturbed(client: Client, pool: list[list[Job]], concurrency: int) -> list[Outcome]:
    """Every job once, ``concurrency`` sessions at a time."""
    queue = list(pool)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while queue:
            for job in queue.pop(0):
                outcomes.append(await client.send(job, deadline_s=600.0))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


class Load:
    """``concurrency`` clients cycling over the pool's sessions until :meth:`stop`."""

    def __init__(
        self,
        client: Client,
        pool: list[list[Job]],
        reference: dict[str, Outcome],
        concurrency: int,
        hang_after_s: float,
    ) -> None:
        self.client, self.pool, self.reference = client, pool, reference
        self.concurrency, self.hang_after_s = concurrency, hang_after_s
        self.outcomes: list[Outcome] = []
        self._next = 0
        self._stopping = False

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.concurrency)))

    def stop(self) -> None:
        """No new request; those under way end as they end."""
        self._stopping = True

    async def _worker(self) -> None:
        while not self._stopping:
            session = self.pool[self._next % len(self.pool)]
            self._next += 1
            for job in session:
                if self._stopping:
                    return
                ref = self.reference[job.id]
                out = await self.client.send(job, (ref.ended - ref.started) + self.hang_after_s)
                self.outcomes.append(out)
                if out.status != "OK":  # the agent's session is broken: it starts another
                    await asyncio.sleep(RETRY_AFTER_S)
                    break

    def recovered_at(self, since: float) -> float | None:
        """When the first request sent after ``since`` completed."""
        ends = [o.ended for o in self.outcomes if o.started > since and o.status == "OK"]
        return min(ends, default=None)


# -- the cluster and the faults -----------------------------------------------------------------


class Cluster:
    """The faults' view of a started launcher (its supervisor on a thread) on its hosts."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.spec = launcher.spec

    @property
    def hosts(self) -> netns.Hosts:
        assert self.launcher.net is not None
        return self.launcher.net.hosts

    def child(self, name: str) -> Child:
        (child,) = [c for c in self.launcher.children if c.name == name]
        return child

    def host_of(self, name: str) -> netns.Host:
        address = self.child(name).address.rsplit(":", 1)[0]
        (host,) = [h for h in self.hosts if h.address == address]
        return host

    def gateway(self) -> str:
        return f"{self.child('gateway').address.rsplit(':', 1)[0]}:{self.spec.grpc_port}"

    def settled(self, timeout: float) -> bool:
        """Every unit serving (restarted ones too), every worker registered again."""
        deadline = time.monotonic() + timeout
        expected = {c.name for c in self.launcher.children if c.role in WORKER_ROLES}
        while time.monotonic() < deadline:
            units = self.launcher.units.values()
            if all(u.state == "serving" for u in units):
                seen = {v.record.worker_id for v in self.views()}
                if expected <= seen:
                    return True
            time.sleep(0.25)
        return False

    def held_blocks(self, timeout: float) -> int:
        """KV blocks the workers still hold once they had ``timeout`` s to free them."""
        deadline = time.monotonic() + timeout
        while True:
            held = sum(
                v.load.total_kv_blocks - v.load.free_kv_blocks
                for v in self.views()
                if v.load is not None and v.record.role in WORKER_ROLES
            )
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.25)

    def views(self) -> list[WorkerView]:
        try:
            return worker_views(self.launcher.redis_url, self.spec.cluster)
        except Exception:  # Redis restarting: no view yet
            return []

    def inject(self, fault: Fault) -> None:
        """Make ``fault`` happen and, where it ends by itself, end it (blocking)."""
        if fault.kind in ("kill", "redis"):
            os.kill(self.child(fault.target).proc.pid, signal.SIGKILL)
        elif fault.kind == "stop":
            pid = self.child(fault.target).proc.pid
            os.kill(pid, signal.SIGSTOP)
            time.sleep(fault.hold_s)
            os.kill(pid, signal.SIGCONT)
        elif fault.kind in ("partition", "slow"):
            prefill = self.host_of("prefill-0")
            decodes = {self.host_of(c.name) for c in self.launcher.children if c.role == "decode"}
            delayers = []
            try:
                if fault.kind == "partition":
                    for host in decodes:
                        netns.cut(prefill, host)
                else:
                    delayers = netns.slow(prefill, list(decodes), SLOW_DELAY_MS, SLOW_LOSS)
                time.sleep(fault.hold_s)
            finally:
                for host in (prefill, *decodes):
                    netns.heal(host)
                for proc in delayers:
                    proc.terminate()
                    proc.wait()


# -- one fault ----------------------------------------------------------------------------------


async def run_fault(
    cluster: Cluster, client: Client, load: Load, fault: Fault, storm: int
) -> dict[str, Any]:
    task = asyncio.create_task(load.run())
    await asyncio.sleep(LEAD_S)
    t0 = time.monotonic()
    storm_outcomes: list[Outcome] = []
    if fault.kind == "disconnects":  # many clients hang up mid-stream at once
        jobs = [j for session in load.pool for j in session][:storm]
        storm_outcomes = await asyncio.gather(
            *(client.send(j, 120.0, cancel_after=1 + i % 4) for i, j in enumerate(jobs))
        )
    else:
        await asyncio.to_thread(cluster.inject, fault)
    recovery = None
    while time.monotonic() - t0 < RECOVERY_LIMIT_S:
        if (at := load.recovered_at(t0)) is not None:
            recovery = at - t0
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(TAIL_S)
    load.stop()
    await task
    settled = await asyncio.to_thread(cluster.settled, 120.0)
    held = await asyncio.to_thread(cluster.held_blocks, 30.0)
    return summarize(fault, load, storm_outcomes, recovery, held, settled)


def summarize(
    fault: Fault,
    load: Load,
    storm: list[Outcome],
    recovery: float | None,
    held: int,
    settled: bool,
) -> dict[str, Any]:
    outs = load.outcomes
    failed = Counter(o.status for o in outs if o.status not in ("OK", "HUNG"))
    completed = [o for o in outs if o.status == "OK"]
    mismatched = [o.id for o in completed if o.tokens != load.reference[o.id].tokens]
    details = sorted({f"{o.status}: {o.detail}"[:160] for o in outs if o.detail})
    return {
        "name": fault.name,
        "kind": fault.kind,
        "requests": len(outs),
        "completed": len(completed),
        "failed": dict(failed),
        "hung": sum(o.status == "HUNG" for o in outs),
        "leaked_kv_blocks": held,
        "mismatched_outputs": len(mismatched),
        "recovery_s": None if recovery is None else round(recovery, 2),
        "settled": settled,
        "client_cancelled": sum(o.status == "CANCELLED" for o in storm),
        "errors_seen": details[:8],
    }


# -- the run ------------------------------------------------------------------------------------


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    worker = ["--model", args.model, "--log-level", "warning", "--enforce-eager"]
    quiet = ["--log-level", "warning", "--migration-limit", "2"]
    return ClusterSpec(
        prefill=1,
        decode=1 if not args.short else 2,
        decode_dep=2 if not args.short else 1,
        hosts=args.hosts,
        scheduler_port=40100,
        gateway_port=40101,
        grpc_port=40102,
        cluster="chaos",
        serve_args={
            "prefill": worker,
            "decode": worker,
            "scheduler": quiet,
            "eplb": ["--log-level", "warning"],
            "gateway": ["--model", args.model, *quiet],
        },
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--short", action="store_true", help="one fault of each kind, 1P2D")
    p.add_argument("--hosts", type=int, default=0, help="default: one per service group")
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--sessions", type=int, default=12, help="sessions in the pool")
    p.add_argument("--max-context", type=int, default=1536, help="tokens of a session's context")
    p.add_argument("--hang-after", type=float, default=60.0)
    p.add_argument("--storm", type=int, default=24, help="clients that hang up at once")
    p.add_argument("--only", default="", help="run only the faults whose name contains this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest/results/chaos.json")
    args = p.parse_args(argv)
    if not args.hosts:  # redis, the control plane, then a host per worker process
        args.hosts = 2 + (3 if args.short else 4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        netns.check_can_make_hosts()
    except netns.HostsUnavailable as e:
        say(str(e))
        return 2
    chosen = [f for f in faults(args.short) if args.only in f.name]
    pool = job_pool(args.sessions, args.max_context, args.seed)
    header = record()
    started = time.time()
    with launched(cluster_spec(args), supervise=True) as launcher:
        cluster = Cluster(launcher)
        say(f"cluster up on {args.hosts} hosts: {launcher.net.describe()}")  # type: ignore[union-attr]
        rows = asyncio.run(_faults(cluster, pool, chosen, args))
    result = {
        **header,
        "hosts": args.hosts,
        "cluster": "1 prefill, "
        + ("2 decode" if args.short else "1 decode + a DEP2 decode group")
        + ", UCX over TCP between hosts, --migration-limit 2, restart on failure",
        "workload": {
            "sessions": args.sessions,
            "requests_in_pool": sum(len(s) for s in pool),
            "concurrency": args.concurrency,
            "max_context_tokens": args.max_context,
            "greedy": True,
            "hang_after_s": args.hang_after,
        },
        "seconds": round(time.time() - started, 1),
        "faults": rows,
    }
    write_result(args.out, result)
    print(table(rows))
    say(f"wrote {args.out}")
    bad = [r["name"] for r in rows if r["hung"] or r["leaked_kv_blocks"] or r["mismatched_outputs"]]
    if bad:
        say(f"hung, leaked or mismatched under: {', '.join(bad)}")
    return 1 if bad or len(rows) < len(chosen) else 0


async def _faults(
    cluster: Cluster, pool: list[list[Job]], chosen: list[Fault], args: argparse.Namespace
) -> list[dict[str, Any]]:
    client = Client(cluster.gateway(), args.model)
    try:
        t = time.monotonic()
        calm = await undisturbed(client, pool, args.concurrency)
        bad = [o for o in calm if o.status != "OK"]
        if bad:
            raise RuntimeError(f"the undisturbed round failed: {bad[0].status} {bad[0].detail}")
        reference = {o.id: o for o in calm}
        say(f"undisturbed round: {len(calm)} requests in {time.monotonic() - t:.1f} s")
        rows = []
        for fault in chosen:
            load = Load(client, pool, reference, args.concurrency, args.hang_after)
            row = await run_fault(cluster, client, load, fault, args.storm)
            say(_brief(row))
            rows.append(row)
        return rows
    finally:
        await client.close()


def _brief(row: dict[str, Any]) -> str:
    return (
        f"{row['name']}: {row['completed']}/{row['requests']} completed, failed {row['failed']}, "
        f"hung {row['hung']}, leaked {row['leaked_kv_blocks']}, mismatched "
        f"{row['mismatched_outputs']}, recovered in {row['recovery_s']} s"
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| fault | requests | completed | failed (status: n) | hung | leaked KV blocks "
        "| mismatched | recovery s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(r["failed"].items())) or "0"
        lines.append(
            f"| {r['name']} | {r['requests']} | {r['completed']} | {failed} | {r['hung']} "
            f"| {r['leaked_kv_blocks']} | {r['mismatched_outputs']} | {r['recovery_s']} |"
        )
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"chaos: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
