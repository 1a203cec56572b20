"""The disaggregated cluster end to end: real redis-server, real `ferry up` processes, gRPC.

Cluster A (1 prefill, 2 decode, UCX, kv_aware, --migration-limit 1) serves, in file order:
parity, metrics, streaming, cancellation, validation, Redis restart, a second scheduler replica,
then the failure tests: kill -9 of the scheduler and of decode-1 (both restarted by `ferry up`),
kill -9 of the decode worker streaming a request (which moves on), a prefill worker whose UCX
cannot connect, SIGTERM of decode-0 (a clean exit: not restarted). Cluster B (2 prefill, 1 decode, gRPC transport,
round_robin) is for the prefill failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ferry.infra.ports import free_port
from ferry.protos import common_pb2
from ferry.services.common.convert import sampling_params_to_pb
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, Result, cancel_mid_stream, ferry_up, generate, greedy
from tests.helpers import Checkpoint
from tests.redis_server import RedisServer

BLOCK_SIZE, NUM_BLOCKS = 16, 256
WORKER_ARGS = (
    f"--block-size {BLOCK_SIZE} --verify-checksum --transfer-timeout 5 --kv-probe-interval 1"
)
MIGRATING = '"event": "migrating"'  # the scheduler's log line when it moves a request
# wide logit margins: greedy tokens cannot flip with batch composition
CHECKPOINT = Checkpoint(seed=3, lm_head_scale=20.0)


@pytest.fixture(scope="module")
def cluster_a(redis: RedisServer, checkpoint: Path) -> Iterator[Cluster]:
    """Keepalive 60 s: a hung worker is found by its heartbeat key expiring (3 s), not by the
    connection's pings (cluster B, at the 3 s default, is found by whichever comes first).
    On a machine loaded by others two defaults fail tests of the machine, not of the cluster,
    so the decode workers differ: a grace of 60 s on SIGTERM, not 5 (the streams a SIGTERM
    lands in must end within it, however slowly the machine decodes: at 5 s they were cut and
    moved), and nice 0, not 19 (behind every process on the host, a worker's heartbeats
    missed its 3 s ttl and the scheduler took it for hung)."""
    with ferry_up(
        redis.url,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--worker-args",
        WORKER_ARGS,
        "--decode-args",
        "--grace 60",
        "--decode-nice",
        "0",
        "--migration-limit",
        "1",
        "--keepalive",
        "60",
        cluster="a",
    ) as c:
        yield c


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(5 + 23 * i)] for i in range(n)]


def seeded(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        top_p=0.95,
        frequency_penalty=0.3,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def run(*coros: object) -> list[Result]:
    async def main() -> list[Result]:
        return list(await asyncio.gather(*coros))  # type: ignore[arg-type]

    return asyncio.run(main())


def test_the_control_plane_runs_without_torch(cluster_a: Cluster) -> None:
    """`ferry up` itself, the gateway and the scheduler never load torch (its library is not
    mapped into them); the workers that run the model do."""

    def torch_loaded(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    roles = cluster_a.children()
    assert {"gateway", "scheduler", "prefill", "decode"} <= roles.keys(), roles
    assert not torch_loaded(cluster_a.proc.pid)
    for role in ("gateway", "scheduler"):
        assert not any(torch_loaded(pid) for pid in roles[role]), role
    assert all(torch_loaded(pid) for pid in roles["prefill"] + roles["decode"])


def test_ferry_up_says_each_service_is_up_as_it_starts(cluster_a: Cluster) -> None:
    """`make run` is not silent while the workers load the model: each service's start shows."""
    assert cluster_a.said("started prefill-0, decode-0, decode-1, scheduler-0; the workers load")
    for name in ("prefill-0", "decode-0", "decode-1", "scheduler-0"):
        assert cluster_a.said(f"{name} is up"), name
    assert cluster_a.said(f"gateway is up ({cluster_a.gateway})")


def test_a_second_cluster_on_the_same_ports_exits_2_and_the_first_serves_on(
    cluster_a: Cluster,
) -> None:
    """gRPC servers would share a port (SO_REUSEPORT): a second `ferry up` on the first's
    scheduler port would have served its clients. It is refused before it starts anything."""
    port = int(cluster_a.scheduler.rsplit(":", 1)[1])
    up = [sys.executable, "-P", "-m", "ferry.infra.cli", "up", "--cluster", "second"]
    second = subprocess.run(
        [*up, "--scheduler-port", str(port), "--no-gateway"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stderr
    assert f":{port}" in second.stderr and "--scheduler-port" in second.stderr, second.stderr
    assert "ferry up: started" not in second.stderr, second.stderr
    (r,) = run(generate(cluster_a.scheduler, prompts(1)[0], greedy(3, ignore_eos=True)))
    assert r.code is None and len(r.token_ids) == 3


def test_greedy_and_seeded_outputs_equal_the_in_process_engine(
    cluster_a: Cluster, checkpoint: Path
) -> None:
    """Half the requests greedy, half seeded: a seeded request draws its first token on the
    prefill worker and the rest on a decode worker, and gets the tokens it gets in one engine."""
    ps = prompts(16)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        if i % 2
        else seeded(100 + i, 12)
        for i in range(16)
    ]
    results = run(
        *(
            generate(cluster_a.scheduler, p, sampling_params_to_pb(sp))
            for p, sp in zip(ps, params, strict=True)
        )
    )
    engine = Engine(
        EngineConfig(model=str(checkpoint), block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    )
    expected = engine.generate(ps, params)
    for res, ref in zip(results, expected, strict=True):
        assert res.code is None, res.details
        assert res.token_ids == ref.token_ids and res.finish_reason == "length"
    decodes = {v.record.worker_id for v in cluster_a.views("decode")}
    assert decodes == {"decode-0", "decode-1"}
    cluster_a.wait_for("blocks free", cluster_a.all_blocks_free, 5)


def test_every_service_serves_prometheus_metrics(cluster_a: Cluster) -> None:
    expect = {
        "scheduler": "ferry_scheduler_time_to_first_token_seconds_count",
        "prefill": "ferry_prefill_requests_total",
        "decode": "ferry_decode_tokens_per_message_count",
    }
    for view in cluster_a.views():
        r = view.record
        url = f"http://127.0.0.1:{r.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        (line,) = [ln for ln in text.splitlines() if ln.startswith(expect[r.role])]
        assert float(line.split()[-1]) > 0, (r.worker_id, line)
        # its own role's families only (beside the engine's and KV transfer's on a worker)
        others = {"ferry_scheduler_", "ferry_prefill_", "ferry_decode_", "ferry_gateway_"}
        others -= {f"ferry_{r.role}_"}
        families = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ferry_")}
        foreign = [f for f in families if f.startswith(tuple(others))]
        assert not foreign, (r.worker_id, foreign)
        if r.role != "scheduler":  # the engine's gauges, labelled with the worker's id
            blocks = f'ferry_engine_kv_blocks{{worker="{r.worker_id}"}} '
            (line,) = [ln for ln in text.splitlines() if ln.startswith(blocks)]
            assert float(line.split()[-1]) == r.num_kv_blocks, line


def test_first_token_arrives_before_decode_starts(cluster_a: Cluster) -> None:
    """With every decode worker stopped, the first token still reaches the client."""

    async def main() -> Result:
        with cluster_a.stopped("decode-0", "decode-1"):
            async with grpc.aio.insecure_channel(cluster_a.scheduler) as ch:
                from ferry.protos import scheduler_pb2, scheduler_pb2_grpc

                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                call = stub.Generate(
                    scheduler_pb2.GenerateRequest(
                        prompt_token_ids=prompts(3)[2], sampling_params=greedy(8, ignore_eos=True)
                    )
                )
                first = await asyncio.wait_for(call.read(), 20)
        assert len(first.token_ids) == 1 and not first.finish_reason
        return await generate(cluster_a.scheduler, prompts(3)[2], greedy(8, ignore_eos=True))

    rest = asyncio.run(main())
    assert rest.code is None and len(rest.token_ids) == 8


def test_cancel_mid_stream_frees_blocks_on_both_workers(cluster_a: Cluster) -> None:
    cancel_mid_stream(cluster_a, prompts(4), "decode")


def test_cancel_between_prefill_and_decode_releases_the_lease(cluster_a: Cluster) -> None:
    async def main() -> None:
        from ferry.protos import scheduler_pb2, scheduler_pb2_grpc

        with cluster_a.stopped("decode-0", "decode-1"):
            async with grpc.aio.insecure_channel(cluster_a.scheduler) as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                call = stub.Generate(
                    scheduler_pb2.GenerateRequest(
                        prompt_token_ids=prompts(6)[5], sampling_params=greedy(20)
                    )
                )
                await asyncio.wait_for(call.read(), 20)
                call.cancel()

                def lease_released() -> bool:  # the decode workers are stopped meanwhile
                    (prefill,) = cluster_a.views("prefill")
                    return prefill.load is not None and (
                        prefill.load.free_kv_blocks == prefill.load.total_kv_blocks
                    )

                await asyncio.to_thread(cluster_a.wait_for, "lease released", lease_released, 10)

    asyncio.run(main())
    cluster_a.wait_for("lease released", cluster_a.all_blocks_free, 5)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], greedy(4), "prompt_token_ids is empty"),
        ([1, 2, 3], greedy(0), "max_tokens must be at least 1"),
        ([1, 2, 3], greedy(-5), "max_tokens must be at least 1"),
        ([1] * 1020, greedy(10), "exceeds the model's limit of 1024"),
        ([1, 2, 3], greedy(4, temperature=-1.0), "temperature must be >= 0"),
        ([1, 2, 3], greedy(4, top_p=2.0), "top_p must be in (0, 1]"),
        ([1, 2, 3], greedy(4, temperature=float("nan")), "temperature must be a finite number"),
        ([1, 99999], greedy(4), "outside the vocabulary"),
    ],
)
def test_invalid_requests_are_refused_and_allocate_nothing(
    cluster_a: Cluster, prompt: list[int], params: object, message: str
) -> None:
    (res,) = run(generate(cluster_a.scheduler, prompt, params))  # type: ignore[arg-type]
    assert res.code == grpc.StatusCode.INVALID_ARGUMENT and message in res.details, res.details
    assert res.chunks == 0
    assert cluster_a.all_blocks_free()


def test_a_resumed_request_goes_on_and_counts_the_whole_request(cluster_a: Cluster) -> None:
    """GenerateRequest.resumed (the gateway's migration): the prompt ends with 3 tokens the
    client already has; the rest of the greedy output follows, and usage counts all of it."""
    prompt = prompts(1)[0]
    (ref,) = run(generate(cluster_a.scheduler, prompt, greedy(10, ignore_eos=True)))
    assert ref.usage == (len(prompt), 10)
    resumed = common_pb2.Resumed(num_output_tokens=3)
    (rest,) = run(
        generate(
            cluster_a.scheduler,
            [*prompt, *ref.token_ids[:3]],
            greedy(7, ignore_eos=True),
            resumed=resumed,
        )
    )
    assert rest.code is None, rest.details
    assert rest.token_ids == ref.token_ids[3:]
    assert rest.usage == (len(prompt), 10)
    (bad,) = run(
        generate(
            cluster_a.scheduler,
            [1, 2, 3],
            greedy(4),
            resumed=common_pb2.Resumed(num_output_tokens=3),
        )
    )
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "must be less than the 3 prompt tokens" in bad.details
    cluster_a.wait_for("blocks freed", cluster_a.all_blocks_free, 5)


def test_services_re_register_after_a_redis_restart(cluster_a: Cluster, redis: RedisServer) -> None:
    redis.restart()
    cluster_a.wait_for("re-registered", lambda: len(cluster_a.views()) == 4, 15)
    # the scheduler's view refreshes from the new Redis, then serves again
    results = run(*(generate(cluster_a.scheduler, p, greedy(4)) for p in prompts(4)))
    assert all(r.code is None and len(r.token_ids) >= 1 for r in results), results


def test_a_second_scheduler_replica_serves_from_the_same_redis(cluster_a: Cluster) -> None:
    """`ferry serve scheduler` on its own, against cluster A's Redis: no request state is
    shared, so both replicas route to the same workers."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ferry.infra.cli",
        "serve",
        "scheduler",
        "--worker-id",
        "scheduler-1",
        "--port",
        str(port),
        "--redis-url",
        cluster_a.redis_url,
        "--cluster",
        "a",
    ]
    proc = subprocess.Popen(cmd)
    try:
        replica = f"127.0.0.1:{port}"
        names = lambda: {v.record.worker_id for v in cluster_a.views("scheduler")}  # noqa: E731
        cluster_a.wait_for("replica registered", lambda: "scheduler-1" in names(), 30)
        ps = prompts(6)
        results = run(
            *(
                generate(addr, p, greedy(6, ignore_eos=True))
                for addr, p in zip([replica, cluster_a.scheduler] * 3, ps, strict=True)
            )
        )
        assert all(r.code is None and len(r.token_ids) == 6 for r in results), results
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        finally:
            if proc.poll() is None:  # it did not stop: fail, and leave nothing behind
                proc.kill()
    assert code == 0
    assert "scheduler-1" not in names()


def test_a_killed_scheduler_is_restarted_on_its_port(cluster_a: Cluster) -> None:
    """kill -9 of the scheduler: `ferry up` starts it again on the same port, so the gateway
    (and any client) keeps its address. A request sent to the gateway while the scheduler is
    down waits for it (--scheduler-wait) instead of failing."""
    host, port = cluster_a.scheduler.rsplit(":", 1)
    cluster_a.signal("scheduler-0", signal.SIGKILL)
    cluster_a.wait_for("scheduler-0 gone", lambda: not _accepts(host, int(port)), 10)
    with urllib.request.urlopen(f"{cluster_a.gateway}/v1/models", timeout=10) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps(
        {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"{cluster_a.gateway}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.load(reply)["usage"]["completion_tokens"] == 4
    back = lambda: cluster_a.said("scheduler-0 is serving again")  # noqa: E731
    cluster_a.wait_for("scheduler-0 restarted", back, 30)
    assert cluster_a.said("scheduler-0 exited with code -9")
    cluster_a.restarted("scheduler-0", 5)


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def test_killed_decode_worker_is_routed_around_and_restarted(cluster_a: Cluster) -> None:
    """kill -9 of decode-1: requests sent at once are retried on decode-0, the dead process
    leaves the registry (its record expires), and `ferry up` starts decode-1 again (--restart
    on-failure, the default) on its port."""
    dead = cluster_a.pids["decode-1"]
    (address,) = [v.record.address for v in cluster_a.views() if v.record.worker_id == "decode-1"]
    cluster_a.signal("decode-1", signal.SIGKILL)
    # requests sent at once may be routed to the dead worker: they are retried on decode-0
    results = run(
        *(generate(cluster_a.scheduler, p, greedy(6, ignore_eos=True)) for p in prompts(8))
    )
    assert all(r.code is None and len(r.token_ids) == 6 for r in results), results
    gone = lambda: dead not in {v.record.pid for v in cluster_a.views()}  # noqa: E731
    cluster_a.wait_for("decode-1's record expired", gone, 30)  # its ttl: test_cluster_state
    cluster_a.restarted("decode-1", 60)
    assert cluster_a.said("decode-1 exited with code -9")
    assert cluster_a.said("restarting decode-1 in 1 s")
    assert [
        v.record.address for v in cluster_a.views("decode") if v.record.worker_id == "decode-1"
    ] == [address]
    results = run(
        *(generate(cluster_a.scheduler, p, greedy(6, ignore_eos=True)) for p in prompts(8))
    )
    assert all(r.code is None and len(r.token_ids) == 6 for r in results), results


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_request_whose_decode_worker_dies_or_hangs_mid_stream_moves_on(
    cluster_a: Cluster, checkpoint: Path, how: signal.Signals
) -> None:
    """--migration-limit 1: kill -9 of the decode worker that is streaming a seeded request, or
    SIGSTOP (its connection stays open and says nothing, but its heartbeat key expires, and
    the scheduler cuts the call). The request goes on from where it was (prefilled again with
    what it had generated, decoded on the other worker); the client gets the tokens and the
    text of a request that never moved: its draws go on from their places."""
    from ferry.protos import scheduler_pb2, scheduler_pb2_grpc

    prompt, n = prompts(2)[1], 900
    stopped: list[str] = []

    async def main() -> tuple[list[int], str, str, int, str]:
        async with grpc.aio.insecure_channel(cluster_a.scheduler) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            sent_at = time.time()
            call = stub.Generate(
                scheduler_pb2.GenerateRequest(
                    request_id="moved",
                    prompt_token_ids=prompt,
                    sampling_params=sampling_params_to_pb(seeded(11, n)),
                ),
                timeout=60,
            )
            tokens, text, finish, killed_after, busy = [], "", "", 0, ""
            async for chunk in call:
                assert chunk.request_id == "moved"  # not the moved part's worker-side id
                tokens += chunk.token_ids
                text += chunk.text
                finish = chunk.finish_reason
                if not killed_after and len(tokens) >= 20:
                    busy = await asyncio.to_thread(cluster_a.streaming_decode_worker, sent_at)
                    cluster_a.signal(busy, how)
                    if how is signal.SIGSTOP:
                        stopped.append(busy)
                    killed_after = len(tokens)
            return tokens, text, finish, killed_after, busy

    try:
        tokens, text, finish, killed_after, busy = asyncio.run(asyncio.wait_for(main(), 90))
    except BaseException:
        print(cluster_a.log_tail())  # which workers the scheduler tried, and why they failed
        raise
    finally:
        for worker in stopped:
            cluster_a.signal(worker, signal.SIGCONT)
    assert killed_after < n - 100, killed_after  # it was killed mid-stream
    engine = Engine(
        EngineConfig(model=str(checkpoint), block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    )
    (ref,) = engine.generate([prompt], seeded(11, n))
    assert (tokens, text, finish) == (ref.token_ids, ref.text, "length")
    assert cluster_a.logged(MIGRATING)
    if how is signal.SIGKILL:
        cluster_a.restarted(busy, 60)  # the cluster whole again for the tests below
    else:  # its registry key expired (cluster A's keepalive is 60 s): the scheduler cut the
        # call; woken, the worker learns the call was cancelled and frees the request's blocks
        gone = [e for e in cluster_a.events("worker_gone") if e["worker_id"] == busy]
        assert gone and gone[-1]["pid"] == cluster_a.pids[busy], gone
        cluster_a.wait_for("blocks freed", cluster_a.all_blocks_free, 10)


def test_a_worker_whose_ucx_cannot_connect_leaves_and_is_restarted(cluster_a: Cluster) -> None:
    """prefill-0 is left no file descriptor (its RLIMIT_NOFILE lowered from outside), so its
    UCX cannot open a connection, as after a peer wedged it (see ucx.UCX_DEFAULTS): its probe
    (--kv-probe-interval, 1 s here) fails twice in a row, it leaves the cluster with exit code 1
    and `ferry up` starts it afresh, which serves."""
    pid = cluster_a.pids["prefill-0"]
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, limits[1]))  # stdin, stdout, stderr
    try:
        wedged = lambda: cluster_a.logged('"event": "kv_transport_cannot_connect"')  # noqa: E731
        cluster_a.wait_for("prefill-0 noticed", wedged, 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    cluster_a.restarted("prefill-0", 60)
    assert cluster_a.said("prefill-0 exited with code 1")
    results = run(
        *(generate(cluster_a.scheduler, p, greedy(6, ignore_eos=True)) for p in prompts(4))
    )
    assert all(r.code is None and len(r.token_ids) == 6 for r in results), results


def test_sigterm_lets_in_flight_streams_finish(cluster_a: Cluster) -> None:
    """SIGTERM to a decode worker that is streaming: it marks its record draining (nothing new
    is routed to it) and its streams run to the end within the grace period, on it: the
    scheduler neither takes it for hung nor moves them. Its exit is clean, so `ferry up` does
    not restart it, and new requests go to the other decode worker."""
    from ferry.protos import scheduler_pb2, scheduler_pb2_grpc

    pids = cluster_a.settled(60)  # the registry's processes, whatever the tests above restarted
    n = 160  # the signal lands mid-stream; the rest fits in the grace period (cluster_a's)

    def streaming() -> str:  # a decode worker with requests in its batch, by its /metrics
        running = 'ferry_engine_requests_running{worker="%s"}'
        decode = [w for w in pids if w.startswith("decode-")]
        return next((w for w in decode if cluster_a.metric(w, running % w)), "")

    def drained(worker: str) -> int:
        return sum(e.get("worker_id") == worker for e in cluster_a.events("draining"))

    def taken_for_hung(pid: int) -> int:  # the scheduler's cuts of its calls (the tests above)
        return sum(e.get("pid") == pid for e in cluster_a.events("worker_gone"))

    async def main() -> tuple[str, list[int], int, int, int]:
        async with grpc.aio.insecure_channel(cluster_a.scheduler) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            calls = [
                stub.Generate(
                    scheduler_pb2.GenerateRequest(
                        prompt_token_ids=p, sampling_params=greedy(n, ignore_eos=True)
                    ),
                    timeout=120,
                )
                for p in prompts(4)
            ]
            counts = []
            for call in calls:  # the first token, then one from a decode worker
                counts.append(sum([len((await call.read()).token_ids) for _ in range(2)]))
            busy = await asyncio.to_thread(streaming)
            assert busy, "no decode worker runs the streams"
            before = drained(busy), taken_for_hung(pids[busy]), cluster_a.times_logged(MIGRATING)
            os.kill(pids[busy], signal.SIGTERM)
            marked = lambda: drained(busy) > before[0]  # noqa: E731
            await asyncio.to_thread(cluster_a.wait_for, f"{busy} draining", marked, 30)
            for i, call in enumerate(calls):
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    counts[i] += len(chunk.token_ids)
            moved = cluster_a.times_logged(MIGRATING) - before[2]
            return busy, counts, moved, before[1], cluster_a.times_said(f"restarting {busy}")

    busy, counts, moved, hung, restarts = asyncio.run(asyncio.wait_for(main(), 180))
    assert counts == [n] * 4
    # they ended on it: a draining worker stays registered (marked draining), so the scheduler
    # neither cuts its calls as those of a worker that hung nor moves them
    assert moved == 0, cluster_a.log_tail()
    assert taken_for_hung(pids[busy]) == hung, cluster_a.log_tail()
    cluster_a.wait_for(f"{busy} exited", lambda: cluster_a.said(f"{busy} exited with code 0"), 30)
    results = run(
        *(generate(cluster_a.scheduler, p, greedy(6, ignore_eos=True)) for p in prompts(4))
    )
    assert all(r.code is None and len(r.token_ids) == 6 for r in results), results
    cluster_a.wait_for(f"{busy} down", lambda: cluster_a.said(f"{busy} stays down"), 30)
    assert cluster_a.times_said(f"restarting {busy}") == restarts


def test_killed_prefill_worker_retries_what_streamed_nothing(
    redis: RedisServer, checkpoint: Path
) -> None:
    """prefill-0 is stopped with requests queued, then killed: those retry on prefill-1. One
    request whose first token came from prefill-0 but whose KV was never pulled (its decode
    worker was stopped) ends with UNAVAILABLE."""
    with ferry_up(
        redis.url,
        "--prefill",
        "2",
        "--decode",
        "1",
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--kv-transport",
        "grpc",
        "--routing-policy",
        "round_robin",
        "--worker-args",
        WORKER_ARGS,
        cluster="b",
    ) as c:

        async def main() -> tuple[Result, list[Result]]:
            c.signal("decode-0", signal.SIGSTOP)
            try:
                stranded = asyncio.create_task(generate(c.scheduler, prompts(2)[1], greedy(8)))
                # round robin: this one takes prefill-0, and its decode worker is stopped
                prefilled = lambda: c.metric("prefill-0", "ferry_prefill_requests_total") >= 1  # noqa: E731
                await asyncio.to_thread(c.wait_for, "prefill-0 prefilled", prefilled, 30)
                c.signal("prefill-0", signal.SIGSTOP)
                queued = [
                    asyncio.create_task(generate(c.scheduler, p, greedy(5, ignore_eos=True)))
                    for p in prompts(8)
                ]
                in_flight = lambda: c.metric("scheduler-0", "ferry_scheduler_running_requests") >= 9  # noqa: E731
                await asyncio.to_thread(c.wait_for, "all routed", in_flight, 30)
                c.signal("prefill-0", signal.SIGKILL)
            finally:
                c.signal("decode-0", signal.SIGCONT)
            return await stranded, list(await asyncio.gather(*queued))

        stranded, queued = asyncio.run(asyncio.wait_for(main(), 60))
        assert stranded.code == grpc.StatusCode.UNAVAILABLE and stranded.chunks == 1
        assert "prefill-0" in stranded.details, stranded.details
        assert all(r.code is None and len(r.token_ids) == 5 for r in queued), queued
        c.wait_for("blocks free", c.all_blocks_free, 5)
