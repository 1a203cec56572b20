"""Aggregated workers end to end: `ferry up --aggregated N`, real processes, gRPC.

Cluster A is one aggregated worker and nothing else: outputs against the in-process engine,
cancellation, and last a scheduler that crash-loops (`ferry up` gives up on it). Cluster B is
mixed (1 aggregated, 1 prefill, 1 decode), for DeepSeek-V3 and V4: requests go to the aggregated
worker while it is up and to the prefill/decode pair once it is gone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, Result, cancel_mid_stream, ferry_up, generate, greedy
from tests.helpers import Checkpoint
from tests.redis_server import RedisServer

BLOCK_SIZE, NUM_BLOCKS = 16, 256
WORKER_ARGS = f"--block-size {BLOCK_SIZE}"
# wide logit margins: greedy tokens cannot flip with batch composition
CHECKPOINT = Checkpoint(seed=3, lm_head_scale=20.0)


@contextmanager
def up(redis: RedisServer, checkpoint: Path | str, *args: str, cluster: str) -> Iterator[Cluster]:
    with ferry_up(
        redis.url,
        *args,
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--worker-args",
        WORKER_ARGS,
        cluster=cluster,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def aggregated(redis: RedisServer, checkpoint: Path) -> Iterator[Cluster]:
    with up(redis, checkpoint, "--aggregated", "1", cluster="agg") as c:
        yield c


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(5 + 23 * i)] for i in range(n)]


def expected(checkpoint: Path | str, ps: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine(
        EngineConfig(model=str(checkpoint), block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    )
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def run_all(address: str, ps: list[list[int]], n: int) -> list[Result]:
    async def main() -> list[Result]:
        return list(
            await asyncio.gather(*(generate(address, p, greedy(n, ignore_eos=True)) for p in ps))
        )

    return asyncio.run(main())


def blocks_free(c: Cluster) -> bool:
    loads = [v.load for v in c.views() if v.record.role != "scheduler"]
    return bool(loads) and all(
        ld is not None and ld.free_kv_blocks == ld.total_kv_blocks for ld in loads
    )


def paths(c: Cluster) -> dict[str, float]:
    """The scheduler's ferry_scheduler_path_requests_total, by path."""
    (sched,) = c.views("scheduler")
    url = f"http://127.0.0.1:{sched.record.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    prefix = 'ferry_scheduler_path_requests_total{path="'
    return {
        ln[len(prefix) :].split('"')[0]: float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith(prefix)
    }


def test_only_aggregated_workers_are_started(aggregated: Cluster) -> None:
    roles = sorted(v.record.role for v in aggregated.views())
    assert roles == ["aggregated", "scheduler"]
    with urllib.request.urlopen(f"{aggregated.gateway}/health", timeout=5) as reply:
        assert reply.status == 200


def test_greedy_outputs_equal_the_in_process_engine(aggregated: Cluster, checkpoint: Path) -> None:
    ps = prompts(16)
    results = run_all(aggregated.scheduler, ps, 12)
    for res, ref in zip(results, expected(checkpoint, ps, 12), strict=True):
        assert res.code is None, res.details
        assert res.token_ids == ref and res.finish_reason == "length"
    assert paths(aggregated) == {"aggregated": 16.0}
    aggregated.wait_for("blocks free", lambda: blocks_free(aggregated), 5)


def test_cancel_mid_stream_frees_the_blocks(aggregated: Cluster) -> None:
    cancel_mid_stream(aggregated, prompts(4), "aggregated")


@pytest.mark.parametrize("v4", [False, True], ids=["v3", "v4-tiny-grpc"])
def test_mixed_cluster_prefers_aggregated_then_falls_back_to_prefill_decode(
    redis: RedisServer, checkpoint: Path, v4: bool
) -> None:
    """DeepSeek-V3 (a checkpoint, UCX) and V4 (v4-tiny, its blocks and packed state over the
    gRPC transport): the same tokens whichever path serves them."""
    model: str | Path = "v4-tiny" if v4 else checkpoint
    transport = ["--kv-transport", "grpc"] if v4 else []
    ps = prompts(6)
    ref = expected(model, ps, 8)
    # --restart never: aggregated-0 stays down, so every request after the kill takes P/D
    with up(
        redis,
        model,
        *transport,
        "--aggregated",
        "1",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--restart",
        "never",
        cluster="mixed",
    ) as c:
        before = run_all(c.scheduler, ps, 8)
        assert paths(c) == {"aggregated": 6.0}
        c.signal("aggregated-0", signal.SIGKILL)  # its calls fail UNAVAILABLE: P/D takes them
        after = run_all(c.scheduler, ps, 8)
        assert paths(c).get("disaggregated") == 6.0
        for res in (*before, *after):
            assert res.code is None, res.details
        assert [r.token_ids for r in before] == ref == [r.token_ids for r in after]
        c.wait_for("every KV block and state slot free", c.all_blocks_free, 10)


def test_a_scheduler_whose_port_is_taken_stays_down_and_the_cluster_stops(
    aggregated: Cluster,
) -> None:
    """Ends cluster A, so it runs last on it. The scheduler is killed and its port taken by
    another socket: `ferry up` restarts it once (a kill is a crash), the new process cannot bind
    and exits 2 (a usage error), which is never restarted: with no scheduler left, `ferry up`
    stops the cluster and exits 1. (The back-off and giving up on a crash loop: test_restarts.)"""
    host, port = aggregated.scheduler.rsplit(":", 1)
    aggregated.signal("scheduler-0", signal.SIGKILL)
    with socket.socket() as squatter:  # no SO_REUSEPORT: gRPC cannot bind beside it
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        aggregated.wait_for("the port released", lambda: _bound(squatter, host, int(port)), 5)
        squatter.listen()
        assert aggregated.proc.wait(90) == 1
    assert aggregated.times_said("restarting scheduler-0") == 1
    assert aggregated.said("scheduler-0 exited with code 2")
    assert aggregated.said("scheduler-0 stays down")
    assert aggregated.said("no scheduler is left; stopping the cluster")
    # the killed scheduler could not take its record out: it expires with its ttl (3 s)
    aggregated.wait_for("every service left the registry", lambda: not aggregated.views(), 5)


def _bound(sock: socket.socket, host: str, port: int) -> bool:
    try:
        sock.bind((host, port))
    except OSError:
        return False
    return True


def test_a_killed_private_redis_is_restarted_and_the_services_re_register() -> None:
    """Without --redis-url `ferry up` runs its own redis-server. Killed, it is started again on
    its port, empty; every service writes its record again on its next heartbeat, and requests
    are served."""
    with ferry_up(
        "",
        "--aggregated",
        "1",
        "--model",
        "tiny",
        "--worker-args",
        WORKER_ARGS,
        cluster="own-redis",
    ) as c:
        client = Redis.from_url(c.redis_url)
        pid = int(client.info("server")["process_id"])
        client.close()
        os.kill(pid, signal.SIGKILL)
        c.wait_for("redis restarted", lambda: c.said("redis is serving again"), 30)
        assert c.said("redis exited with code -9")
        names = lambda: {v.record.worker_id for v in c.views()}  # noqa: E731
        c.wait_for("re-registered", lambda: {"aggregated-0", "scheduler-0"} <= names(), 10)
        results = run_all(c.scheduler, prompts(3), 4)
        assert all(r.code is None and len(r.token_ids) == 4 for r in results), results
