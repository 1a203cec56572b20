"""The scheduler's request loop in this process: a real Scheduler, called directly, against
real worker services (PrefillWorker, DecodeWorker, AggregatedWorker on the tiny model, their KV
over the in-process transport) registered in a real redis-server. Failures are real too: a worker
whose server is stopped while its registry record lives on (a crash), one that is full."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from ferry.infra.ports import free_port
from ferry.protos import common_pb2, scheduler_pb2
from ferry.services.common.cluster_state import ClusterState, LoadReport
from ferry.services.common.config import ServiceConfig
from ferry.services.common.server import serve
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.scheduler import metrics
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.service import Failed, Scheduler
from ferry.services.worker.aggregated import AggregatedWorker
from ferry.services.worker.config import WorkerConfig
from ferry.services.worker.decode import DecodeWorker
from ferry.services.worker.engine_worker import EngineWorker
from ferry.services.worker.prefill import PrefillWorker
from tests.redis_server import RedisServer
from tests.waits import wait_until_async

ROLES: dict[str, type[EngineWorker]] = {
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "aggregated": AggregatedWorker,
}
BLOCK_SIZE = 16


@dataclass
class Node:
    """One worker service, serving in this process."""

    worker: EngineWorker
    task: asyncio.Task[None]

    async def crash(self) -> None:
        """Stop serving at once: calls in flight fail (the server stops with no grace)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@dataclass
class InProcessCluster:
    redis_url: str
    cluster: str
    nodes: dict[str, Node] = field(default_factory=dict)
    dead: list[ClusterState] = field(default_factory=list)

    async def worker(self, role: str, worker_id: str, **engine: object) -> Node:
        svc = ServiceConfig(
            worker_id=worker_id,
            metrics_port=-1,
            redis_url=self.redis_url,
            cluster=self.cluster,
            grace_s=0.0,
        )
        eng = EngineConfig(model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=64, **engine)  # type: ignore[arg-type]
        service = ROLES[role](WorkerConfig(service=svc, engine=eng, kv_transport="local"))
        task = asyncio.create_task(serve(svc, service))

        async def registered() -> bool:
            if task.done():
                task.result()  # it failed to start: say why
            return any(v.record.worker_id == worker_id for v in await service.cluster.workers())

        await wait_until_async(f"{worker_id} registered", registered, 60, every=0.02)
        self.nodes[worker_id] = Node(service, task)
        return self.nodes[worker_id]

    async def dead_worker(self, worker_id: str, like: Node) -> ClusterState:
        """A registry record, heartbeating, for a worker whose process is gone: ``like``'s
        record and load, at an address where nothing listens (a crashed worker looks so to
        the scheduler until its record expires)."""
        live = next(
            v
            for v in await like.worker.cluster.workers()
            if v.record.worker_id == like.worker.worker_id
        )
        record = dataclasses.replace(
            live.record, worker_id=worker_id, address=f"127.0.0.1:{free_port()}"
        )
        state = ClusterState(self.redis_url, self.cluster)
        load = live.load or LoadReport()
        await state.register(record, lambda: dataclasses.replace(load, updated_at=time.time()))
        self.dead.append(state)
        return state

    async def scheduler(self, **kw: object) -> Scheduler:
        svc = ServiceConfig(
            worker_id="scheduler", metrics_port=-1, redis_url=self.redis_url, cluster=self.cluster
        )
        scheduler = Scheduler(SchedulerConfig(service=svc, **kw))  # type: ignore[arg-type]
        await scheduler.start("in-process", -1)
        return scheduler

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.crash()
        for state in self.dead:
            await state.close()


@asynccontextmanager
async def in_process(redis: RedisServer, name: str) -> AsyncIterator[InProcessCluster]:
    cluster = InProcessCluster(redis.url, name)
    try:
        yield cluster
    finally:
        await cluster.close()


def request(prompt: list[int], max_tokens: int) -> scheduler_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return scheduler_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)


@functools.cache
def _reference() -> Engine:
    return Engine(EngineConfig(model="tiny", block_size=BLOCK_SIZE))


def engine_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What one engine generates for the request, greedy: the reference for every path."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return _reference().generate([prompt], params)[0].token_ids


async def tokens_of(
    scheduler: Scheduler, req: scheduler_pb2.GenerateRequest, rid: str
) -> list[int]:
    out: list[int] = []
    async for chunk in scheduler.generate(req, rid):
        assert chunk.request_id == rid
        out += chunk.token_ids
    return out


def counter(c: object, *labels: str) -> float:
    metric = c.labels(*labels) if labels else c  # type: ignore[attr-defined]
    return float(metric._value.get())


PROMPT = [(5 * j) % 250 + 1 for j in range(40)]


def test_prefill_then_decode_equals_one_engine_and_frees_everything(redis: RedisServer) -> None:
    async def main() -> None:
        async with in_process(redis, "pd") as c:
            prefill = await c.worker("prefill", "prefill-0")
            decode = await c.worker("decode", "decode-0")
            scheduler = await c.scheduler()
            try:
                got = await tokens_of(scheduler, request(PROMPT, 12), "r1")
            finally:
                await scheduler.close()
            assert got == engine_tokens(PROMPT, 12)
            assert len(prefill.worker.exporter.leases) == 0  # pulled, then released
            load = decode.worker.engine.load
            assert load.running == 0 and load.free_kv_blocks == load.total_kv_blocks

    asyncio.run(main())


def test_a_dead_decode_worker_is_retried_on_another(redis: RedisServer) -> None:
    """decode-a is picked first (the policy's tie goes to the lower id), but its process is
    gone while its record lives on: the Decode fails UNAVAILABLE and goes to decode-b."""

    async def main() -> None:
        async with in_process(redis, "retry") as c:
            await c.worker("prefill", "prefill-0")
            live = await c.worker("decode", "decode-b")
            await c.dead_worker("decode-a", like=live)
            scheduler = await c.scheduler(routing_policy="least_loaded")
            assert {v.record.worker_id for v in scheduler.view.workers("decode")} == {
                "decode-a",
                "decode-b",
            }
            retries = counter(metrics.RETRIES, "decode")
            try:
                got = await tokens_of(scheduler, request(PROMPT, 8), "r2")
            finally:
                await scheduler.close()
            assert got == engine_tokens(PROMPT, 8)
            assert counter(metrics.RETRIES, "decode") == retries + 1
            assert c.nodes["decode-b"].worker.engine.load.running == 0

    asyncio.run(main())


def test_a_worker_that_joined_since_the_last_read_takes_the_retry(redis: RedisServer) -> None:
    """The only decode worker the scheduler's view holds is gone; decode-b registered after the
    view's last read (its periodic refresh is an hour away here). The failed Decode reads the
    registry again before it gives up, and goes to decode-b."""

    async def main() -> None:
        async with in_process(redis, "stale-view") as c:
            await c.worker("prefill", "prefill-0")
            template = await c.worker("decode", "decode-t")
            await c.dead_worker("decode-a", like=template)
            await template.crash()
            await template.worker.cluster.deregister()
            scheduler = await c.scheduler(refresh_s=3600.0)
            try:
                assert {v.record.worker_id for v in scheduler.view.workers("decode")} == {
                    "decode-a"
                }
                await c.worker("decode", "decode-b")
                got = await tokens_of(scheduler, request(PROMPT, 8), "r-stale")
            finally:
                await scheduler.close()
            assert got == engine_tokens(PROMPT, 8)
            assert "decode-b" in {v.record.worker_id for v in scheduler.view.workers("decode")}

    asyncio.run(main())


def test_a_full_aggregated_worker_falls_back_to_prefill_then_decode(redis: RedisServer) -> None:
    """The aggregated worker runs one request at most (max_num_seqs 1): while it streams one,
    the next is refused RESOURCE_EXHAUSTED and served by the prefill and decode workers."""

    async def main() -> None:
        async with in_process(redis, "fallback") as c:
            agg = await c.worker("aggregated", "agg-0", max_num_seqs=1)
            await c.worker("prefill", "prefill-0")
            await c.worker("decode", "decode-0")
            scheduler = await c.scheduler()
            first = scheduler.generate(request(PROMPT, 200), "long")
            try:
                long_tokens = list((await anext(first)).token_ids)  # it runs on agg-0 now
                assert agg.worker.engine.load.running == 1
                paths = counter(metrics.PATHS, "disaggregated")
                short = [3, *PROMPT[:20]]
                assert await tokens_of(scheduler, request(short, 6), "spill") == engine_tokens(
                    short, 6
                )
                assert counter(metrics.PATHS, "disaggregated") == paths + 1
                async for chunk in first:
                    long_tokens += chunk.token_ids
            finally:
                await first.aclose()
                await scheduler.close()
            assert long_tokens == engine_tokens(PROMPT, 200)

    asyncio.run(main())


def test_a_decode_worker_that_dies_mid_stream_moves_the_request(redis: RedisServer) -> None:
    """With migration on, the stream goes on from decode-b as prompt + the tokens sent, and
    the client gets the tokens one engine gives, once each."""

    async def main() -> None:
        async with in_process(redis, "migrate") as c:
            await c.worker("prefill", "prefill-0")
            first_decode = await c.worker("decode", "decode-a")
            await c.worker("decode", "decode-b")
            scheduler = await c.scheduler(routing_policy="least_loaded", migration_limit=1)
            moves = counter(metrics.MIGRATIONS)
            got: list[int] = []
            try:
                async for chunk in scheduler.generate(request(PROMPT, 60), "moved"):
                    got += chunk.token_ids
                    if len(got) >= 10 and not first_decode.task.done():
                        await first_decode.crash()  # decode-a served these tokens
            finally:
                await scheduler.close()
            assert got == engine_tokens(PROMPT, 60)
            assert counter(metrics.MIGRATIONS) == moves + 1

    asyncio.run(main())


def test_without_migration_a_worker_that_dies_mid_stream_fails_the_request(
    redis: RedisServer,
) -> None:
    async def main() -> None:
        async with in_process(redis, "nomove") as c:
            await c.worker("aggregated", "agg-0")
            scheduler = await c.scheduler()
            got = 0
            try:
                with pytest.raises(Failed) as failed:
                    async for chunk in scheduler.generate(request(PROMPT, 60), "dies"):
                        got += len(chunk.token_ids)
                        if got >= 5 and not c.nodes["agg-0"].task.done():
                            await c.nodes["agg-0"].crash()
            finally:
                await scheduler.close()
            assert failed.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert "aggregated worker agg-0" in failed.value.message

    asyncio.run(main())


def test_cancelling_generate_aborts_the_request_and_frees_its_blocks(redis: RedisServer) -> None:
    async def main() -> None:
        async with in_process(redis, "cancel") as c:
            prefill = await c.worker("prefill", "prefill-0")
            decode = await c.worker("decode", "decode-0")
            scheduler = await c.scheduler()
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in scheduler.generate(request(PROMPT, 800), "cancelled"):
                    if decode.worker.engine.load.running:  # it decodes there now
                        started.set()

            task = asyncio.create_task(consume())
            try:
                waiting = asyncio.create_task(started.wait())
                await asyncio.wait([waiting, task], timeout=30, return_when="FIRST_COMPLETED")
                assert started.is_set(), task.result() if task.done() else "no decode in 30 s"
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                eng = decode.worker.engine
                await wait_until_async(
                    "the decode worker's request aborted", lambda: not eng.load.running, every=0.02
                )
                load = eng.load
                assert load.free_kv_blocks == load.total_kv_blocks
                assert len(prefill.worker.exporter.leases) == 0
            finally:
                await scheduler.close()

    asyncio.run(main())
