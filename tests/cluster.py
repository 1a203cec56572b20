"""Test helper: a real local cluster started with ``ferry up`` against a test's own Redis."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import grpc

from ferry.infra.ports import free_port
from ferry.protos import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from ferry.services.common.cluster_state import ClusterState, LoadReport, WorkerView
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint
from ferry.services.worker.convert import kv_handle_to_pb
from tests.waits import wait_until

T = TypeVar("T")


@dataclass
class Cluster:
    proc: subprocess.Popen[str]
    redis_url: str
    scheduler: str  # host:port
    cluster: str
    gateway: str = ""  # http://host:port of the OpenAI API
    grpc: str = ""  # host:port of the public gRPC API
    pids: dict[str, int] = field(default_factory=dict)  # worker id -> pid (see restarted)
    log: Path | None = None  # stderr of `ferry up` and its children
    tls_ca: str = ""  # `ferry up --tls`: the CA its services' certificates come from

    def read(self, query: Callable[[ClusterState], Awaitable[T]]) -> T:
        """``query`` on a ClusterState of this cluster's Redis (a fresh connection)."""

        async def run() -> T:
            state = ClusterState(self.redis_url, self.cluster)
            try:
                return await query(state)
            finally:
                await state.close()

        return asyncio.run(run())

    def children(self) -> dict[str, list[int]]:
        """The processes `ferry up` started, by the role in their argv (``serve ROLE``)."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True
        )
        roles: dict[str, list[int]] = {}
        for pid in map(int, out.stdout.split()):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "serve" in argv:
                roles.setdefault(argv[argv.index("serve") + 1], []).append(pid)
        return roles

    def views(self, role: str | None = None) -> list[WorkerView]:
        return self.read(lambda state: state.workers(role))

    def signal(self, worker_id: str, sig: signal.Signals) -> None:
        os.kill(self.pids[worker_id], sig)

    def said(self, message: str) -> bool:
        """`ferry up` printed a line that starts ``ferry up: {message}`` (its own lines, not its
        children's)."""
        return self.times_said(message) > 0

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of `ferry up`'s and its children's output, for a failing test."""
        assert self.log is not None
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def times_said(self, message: str) -> int:
        assert self.log is not None
        lines = self.log.read_text(errors="replace").splitlines()
        return sum(line.startswith(f"ferry up: {message}") for line in lines)

    def logged(self, text: str) -> bool:
        """``text`` is in the output of `ferry up` or of one of its children (their logs)."""
        return self.times_logged(text) > 0

    def times_logged(self, text: str) -> int:
        assert self.log is not None
        return self.log.read_text(errors="replace").count(text)

    def events(self, event: str) -> list[dict[str, object]]:
        """The children's log records (JSON lines) of ``event``."""
        assert self.log is not None
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if f'"{event}"' in line and line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event:
                    found.append(record)
        return found

    def restarted(self, worker_id: str, timeout: float) -> int:
        """Wait until a process other than the one in ``pids`` registers as ``worker_id``;
        returns its pid (and keeps it in ``pids``)."""
        old = self.pids[worker_id]

        def pid() -> int:
            return next((v.record.pid for v in self.views() if v.record.worker_id == worker_id), 0)

        self.wait_for(f"{worker_id} restarted", lambda: pid() not in (0, old), timeout)
        self.pids[worker_id] = pid()
        return self.pids[worker_id]

    def settled(self, timeout: float) -> dict[str, int]:
        """Wait until every worker in ``pids`` is registered (a worker may have left and be
        restarting after the tests before: a peer killed mid-transfer can wedge its UCX, see
        ucx.UCX_DEFAULTS), then take their pids from the registry."""
        self.wait_for(
            "every worker registered",
            lambda: {v.record.worker_id for v in self.views()} >= self.pids.keys(),
            timeout,
        )
        self.pids.update({v.record.worker_id: v.record.pid for v in self.views()})
        return self.pids

    @contextmanager
    def stopped(self, *worker_ids: str) -> Iterator[None]:
        """SIGSTOP the workers for the block (SIGCONT after, whatever happens)."""
        for w in worker_ids:
            self.signal(w, signal.SIGSTOP)
        try:
            yield
        finally:
            for w in worker_ids:
                self.signal(w, signal.SIGCONT)

    def wait_for(self, what: str, ok: Callable[[], object], timeout: float) -> float:
        """``wait_until`` ``ok()``; returns the seconds it took (a failure says which workers
        Redis holds then)."""
        started = time.monotonic()
        wait_until(what, ok, timeout, 0.1, explain=self._registry)
        return time.monotonic() - started

    def _registry(self) -> str:
        return f"registry: {[(v.record.worker_id, v.load) for v in self.views()]}"

    def metric(self, worker_id: str, sample: str) -> float:
        """The sum of the samples of ``worker_id``'s /metrics whose line starts with ``sample``
        (a name, or a name and the start of its labels)."""
        (view,) = [v for v in self.views() if v.record.worker_id == worker_id]
        host = view.record.address.rsplit(":", 1)[0]
        url = f"http://{host}:{view.record.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            lines = reply.read().decode().splitlines()
        return sum(float(ln.split()[-1]) for ln in lines if ln.startswith(sample))

    def streaming_decode_worker(self, since: float) -> str:
        """The decode worker whose heartbeat, sent after ``since``, says it runs a request."""

        def reporting() -> str:
            for v in self.views("decode"):
                if v.load and v.load.running and v.load.updated_at > since:
                    return v.record.worker_id
            return ""

        return wait_until("a decode worker reports a running request", reporting, 30)

    def all_blocks_free(self) -> bool:
        """Every worker's load report says no KV block (free or cached only) and no state slot
        is in use."""
        roles = ("prefill", "decode", "aggregated")
        loads = [v.load for v in self.views() if v.record.role in roles]
        return bool(loads) and all(
            ld is not None
            and ld.free_kv_blocks == ld.total_kv_blocks
            and ld.free_state_slots == ld.total_state_slots
            for ld in loads
        )


@contextmanager
def ferry_up(
    redis_url: str, *args: str, cluster: str = "test", timeout: float = 180.0
) -> Iterator[Cluster]:
    """`ferry up` against ``redis_url`` ("": its own private redis-server)."""
    port, http, public = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "ferry.infra.cli",
        "up",
        "--redis-url",
        redis_url,
        "--scheduler-port",
        str(port),
        "--port",
        str(http),
        "--grpc-port",
        str(public),
        "--cluster",
        cluster,
        *args,
    ]
    # an O_APPEND file, read by path: the children share its offset, so the test must not move it
    fd, name = tempfile.mkstemp(prefix="ferry-up-", suffix=".log")
    os.close(fd)
    log = Path(name)
    with log.open("ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"ferry up exited with {proc.wait()} before it was ready")
            if "ferry up: ready" in line:
                break
            assert time.monotonic() < deadline, "ferry up was not ready in time"
        if not redis_url:  # the endpoints follow: "  redis      redis://HOST:PORT/0  (private)"
            redis_url = proc.stdout.readline().split()[1]
        tls_ca = ""
        if "--tls" in args:  # then "  tls        CA PATH (...)"
            tls_ca = proc.stdout.readline().split()[2]
        host = "127.0.0.1"
        if "--hosts" in args:  # then the hosts, then a line per service: the control host's
            host = _control_host(proc.stdout)
        c = Cluster(
            proc,
            redis_url,
            f"{host}:{port}",
            cluster,
            f"{'https' if tls_ca else 'http'}://{host}:{http}",
            f"{host}:{public}",
            log=log,
            tls_ca=tls_ca,
        )
        c.pids = {v.record.worker_id: v.record.pid for v in c.views()}
        yield c
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sys.stderr.write(log.read_text(errors="replace"))  # pytest shows it on a failure
        log.unlink()


def _control_host(endpoints: IO[str]) -> str:
    """The scheduler's host, from `ferry up --hosts`'s list of endpoints."""
    while line := endpoints.readline():
        name, *rest = line.split()
        if name == "scheduler-0":
            return rest[1].rsplit(":", 1)[0]  # "scheduler-0  grpc HOST:PORT  metrics ..."
    raise AssertionError("ferry up did not list scheduler-0")


def greedy(max_tokens: int, **kw: object) -> common_pb2.SamplingParams:
    kw.setdefault("temperature", 0.0)
    return common_pb2.SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


@dataclass
class Result:
    token_ids: list[int]
    chunks: int
    finish_reason: str
    code: grpc.StatusCode | None = None
    details: str = ""
    cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    usage: tuple[int, int] = (0, 0)  # the last chunk's prompt and completion tokens


async def generate(
    address: str,
    prompt: Sequence[int],
    params: common_pb2.SamplingParams,
    request_id: str = "",
    timeout: float = 60.0,
    resumed: common_pb2.Resumed | None = None,
) -> Result:
    """One Generate call to completion or error (never raises an RPC error)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        req = scheduler_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            resumed=resumed,
        )
        res = Result([], 0, "")
        try:
            async for chunk in stub.Generate(req, timeout=timeout):
                res.token_ids += chunk.token_ids
                res.chunks += 1
                res.finish_reason = chunk.finish_reason
                if chunk.HasField("usage"):
                    res.cached_tokens = chunk.usage.cached_tokens
                    res.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        except grpc.aio.AioRpcError as e:
            res.code, res.details = e.code(), e.details() or ""
        return res


def generate_twice(c: Cluster, prompt: list[int], tokens: int) -> list[tuple[list[int], int]]:
    """``prompt`` through the scheduler twice, one after the other, greedy: each time's
    (token ids, cached prompt tokens)."""

    async def twice() -> list[tuple[list[int], int]]:
        out = []
        for _ in range(2):
            r = await generate(c.scheduler, prompt, greedy(tokens, ignore_eos=True))
            assert r.code is None, r.details
            out.append((r.token_ids, r.cached_tokens))
        return out

    return asyncio.run(twice())


def cancel_mid_stream(c: Cluster, prompts: list[list[int]], role: str) -> None:
    """A long greedy stream per prompt; once each has sent 3 chunks and ``role``'s workers
    report them all running (holding KV blocks), every call is cancelled: the requests are
    aborted and every KV block and state slot is freed."""

    def loads() -> list[LoadReport]:
        return [v.load for v in c.views(role) if v.load is not None]

    def all_running() -> bool:  # as the next heartbeats' load reports say
        return sum(ld.running for ld in loads()) == len(prompts)

    async def main() -> None:
        async with grpc.aio.insecure_channel(c.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            long = greedy(900, ignore_eos=True)
            calls = [
                stub.Generate(
                    scheduler_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=long)
                )
                for p in prompts
            ]
            for call in calls:  # (through P/D: the prefill's first token, then the decode's)
                for _ in range(3):
                    await call.read()
            await asyncio.to_thread(c.wait_for, f"{role} runs them all", all_running, 30)
            held = await asyncio.to_thread(loads)
            assert sum(ld.free_kv_blocks for ld in held) < sum(ld.total_kv_blocks for ld in held)
            for call in calls:
                call.cancel()

    asyncio.run(main())
    c.wait_for("every block free after the cancel", c.all_blocks_free, 30)


def refused_handle(c: Cluster, layout: LayoutFingerprint) -> grpc.aio.AioRpcError:
    """A decode worker's answer to a handle of ``layout`` that names the prefill worker's KV
    address (20 tokens, one block): the error it ends the call with."""
    (prefill,) = c.views("prefill")
    host, port = prefill.record.kv_address.rsplit(":", 1)
    handle = KvHandle(
        "t-other", "prefill-other", host, int(port), 20, 64, 1, layout, time.time() + 30
    )
    decoder = c.views("decode")[0]

    async def call() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(decoder.record.address) as ch:
            stub = decode_worker_pb2_grpc.DecodeWorkerStub(ch)
            request = decode_worker_pb2.DecodeRequest(
                request_id="other-handle",
                prompt_token_ids=list(range(1, 21)),
                sampling_params=greedy(4),
                first_token_id=7,
                kv_handle=kv_handle_to_pb(handle),
            )
            try:
                async for _ in stub.Decode(request, timeout=10):
                    pass
            except grpc.aio.AioRpcError as e:
                return e
        raise AssertionError("the decode worker took a handle of another layout")

    return asyncio.run(call())


def kill_its_decode_worker(
    c: Cluster, prompt: list[int], params: common_pb2.SamplingParams, after: int
) -> tuple[list[int], int, str]:
    """``prompt`` streamed through the scheduler; once ``after`` tokens came, kill -9 of the
    decode worker streaming it. Returns (every token the client got, how many before the kill,
    the killed worker's id)."""

    async def main() -> tuple[list[int], int, str]:
        sent_at = time.time()
        killed_after, victim = 0, ""
        tokens: list[int] = []
        async with grpc.aio.insecure_channel(c.scheduler) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            call = stub.Generate(
                scheduler_pb2.GenerateRequest(
                    request_id="moved", prompt_token_ids=prompt, sampling_params=params
                ),
                timeout=120,
            )
            async for chunk in call:
                tokens += chunk.token_ids
                if not killed_after and len(tokens) >= after:
                    victim = await asyncio.to_thread(c.streaming_decode_worker, sent_at)
                    c.signal(victim, signal.SIGKILL)
                    killed_after = len(tokens)
        return tokens, killed_after, victim

    return asyncio.run(asyncio.wait_for(main(), 150))


def completion_text(c: Cluster, model: str, prompt: list[int], max_tokens: int) -> str:
    """``prompt``'s greedy completion (EOS ignored) through the REST API: its text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        c.gateway + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        text: str = json.loads(r.read())["choices"][0]["text"]
    return text
