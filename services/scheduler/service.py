"""Scheduler over gRPC: ``Generate`` runs one request through prefill, KV transfer and decode,
or on one aggregated worker.

Aggregated workers come first: when one is registered, the request goes to it (the routing
policy picks which), and its one engine prefills and decodes it; no KV moves. When every
aggregated worker refuses (full or down) before streaming anything and prefill workers are
registered, the request takes the disaggregated path below; with no aggregated worker it always
does. So a mixed cluster fills its aggregated workers first and spills over to P/D pairs.

1. Pick a prefill worker (the routing policy, over the ClusterView; ``kv_aware`` weighs how much
   of the prompt each one holds in its prefix cache, from the workers' KV events) and call ``Prefill``; when
   the worker is down or full, retry on another one (bounded, with backoff): nothing has been
   streamed yet.
2. Stream the first token at once (that is the time to first token).
3. Pick a decode worker and stream its ``Decode``. A decode worker that is down or full before
   it sent anything is replaced by another: the KV still waits under its lease on the prefill
   worker. Any later failure ends the stream with the original status, unless the request may
   move (``migration_limit``, as Dynamo's request migration): a worker that died or went away
   after tokens were streamed, and the request goes on from where it was on another worker,
   with what it generated appended to its prompt (``Resumed`` tells the worker which tokens
   those are and how much of their text the client has). Greedy requests go on with the tokens
   they would have had; a seeded one draws new random numbers from its seed.
Cancelling ``Generate`` (or ``Abort``) cancels the worker RPC in flight, which aborts the request
there, and releases a lease that no decode worker has pulled. No request state goes to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from ferry.protos import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from ferry.services.common import convert
from ferry.services.common.channels import ChannelPool
from ferry.services.common.cluster_state import ClusterState, LoadReport, WorkerRecord, WorkerView
from ferry.services.common.config import ServiceConfig
from ferry.services.common.convert import KV_ERROR_KEY
from ferry.services.common.log import bind_request, get_logger
from ferry.services.common.prefix_hash import prefix_hashes
from ferry.services.common.server import Service, abort_with
from ferry.services.common.streamed import Streamed
from ferry.services.scheduler import metrics
from ferry.services.scheduler.cluster_view import ClusterView
from ferry.services.scheduler.policies import POLICIES, Candidate, RouteRequest, create_policy
from ferry.services.scheduler.prefix_index import follow

log = get_logger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A worker that died (UNAVAILABLE), whose KV pull failed or timed out, or that stopped serving
# (its server cancelled the call): the request can go on elsewhere.
MIGRATABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


@dataclass(frozen=True)
class SchedulerConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    routing_policy: str = "kv_aware"
    max_attempts: int = 3  # per stage (prefill, decode), first try included
    retry_backoff_s: float = 0.05  # doubled after every failed attempt
    refresh_s: float = 0.25  # how often the registry and loads are read from Redis
    migration_limit: int = 0  # moves of a request whose worker fails after streaming (0: none)

    def __post_init__(self) -> None:
        if self.routing_policy not in POLICIES:
            raise ValueError(
                f"routing_policy={self.routing_policy!r}: choose one of {', '.join(POLICIES)}"
            )
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")


class Failed(Exception):
    """End the Generate with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Scheduler(Service):
    role = "scheduler"
    service_names = ("ferry.v1.Scheduler",)

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        svc = config.service
        self.worker_id = svc.name_for(self.role)
        self.cluster = ClusterState(svc.redis_url, svc.cluster, svc.heartbeat_s, svc.ttl_s)
        self.view = ClusterView(self.cluster, config.refresh_s, suspect_s=svc.ttl_s)
        self.policy = create_policy(config.routing_policy)
        self._channels = ChannelPool()
        self._active: dict[str, asyncio.Task[object]] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(_Servicer(self), server)

    async def start(self, address: str, metrics_port: int) -> None:
        record = WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            address=address,
            metrics_port=metrics_port,
            pid=os.getpid(),
            started_at=time.time(),
        )
        await self.cluster.register(
            record, lambda: LoadReport(running=len(self._active), updated_at=time.time())
        )
        await self.view.refresh()
        self._refresher = asyncio.create_task(self.view.run())
        if self.policy.uses_prefixes:
            self._follower = asyncio.create_task(follow(self.cluster, self.view.prefix))

    async def drain(self) -> None:
        await self.cluster.deregister()

    async def close(self) -> None:
        for task in (self._refresher, self._follower):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._channels.close()
        await self.cluster.close()

    def channel(self, worker: WorkerRecord) -> grpc.aio.Channel:
        return self._channels.get(worker.address, worker.process)

    # ---- one request ----------------------------------------------------------------------
    async def generate(
        self, request: scheduler_pb2.GenerateRequest, rid: str
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        route = await self._route_request(request, rid)
        started = time.perf_counter()
        sent = Streamed.after(request)
        resumed = request.resumed if request.HasField("resumed") else None
        part, worker_rid = request, rid
        while True:
            try:
                serving = self._serve(part, worker_rid, route, resumed)
                async with contextlib.aclosing(serving) as chunks:
                    async for chunk in chunks:
                        if not sent.token_ids:
                            metrics.TTFT.observe(time.perf_counter() - started)
                        sent.add(chunk)
                        chunk.request_id = rid  # not a moved part's worker-side id
                        metrics.GENERATED_TOKENS.inc(len(chunk.token_ids))
                        if chunk.finish_reason:
                            if resumed is not None:  # usage of the whole request, not of this part
                                sent.count_usage(chunk.usage, request)
                            metrics.PROMPT_TOKENS.inc(chunk.usage.prompt_tokens)
                            metrics.CACHED_TOKENS.inc(chunk.usage.cached_tokens)
                        yield chunk
                        if chunk.finish_reason:
                            return  # what fails after the last chunk is not the client's
                return
            except Failed as f:
                if not (
                    sent.moves < self.config.migration_limit
                    and sent.token_ids
                    and f.code in MIGRATABLE
                ):
                    raise
                sent.moves += 1
                log.warning(
                    "migrating",
                    reason=f.message,
                    code=f.code.name,
                    generated=len(sent.token_ids),
                    migration=sent.moves,
                )
                metrics.MIGRATIONS.inc()
                part = sent.rest(request)
                resumed = part.resumed
                worker_rid = f"{rid}.m{sent.moves}"  # the old one may linger on a worker
                route = await self._route_request(part, rid)

    async def _serve(
        self,
        request: scheduler_pb2.GenerateRequest,
        rid: str,
        route: RouteRequest,
        resumed: common_pb2.Resumed | None = None,
    ) -> AsyncGenerator[common_pb2.TokenChunk, None]:
        """On an aggregated worker when there is one; else, or when every aggregated worker
        refused before streaming and there are prefill workers, prefill then decode."""
        if self.view.workers("aggregated"):
            msg = decode_worker_pb2.DecodeRequest(
                request_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                resumed=resumed,
            )
            streamed = False
            try:
                async for chunk in self._stream("aggregated", msg, route):
                    if not streamed:  # taken: no falling back from here on
                        metrics.PATHS.labels("aggregated").inc()
                        streamed = True
                    yield chunk
                    if chunk.finish_reason:  # done: a failure after this one is not the client's
                        return
                return
            except Failed as f:
                if streamed or f.code not in RETRYABLE or not self.view.workers("prefill"):
                    raise
                log.info(
                    "no aggregated worker took the request; prefill then decode", code=f.code.name
                )
        metrics.PATHS.labels("disaggregated").inc()
        async for chunk in self._disaggregated(request, rid, route, resumed):
            yield chunk

    async def _disaggregated(
        self,
        request: scheduler_pb2.GenerateRequest,
        rid: str,
        route: RouteRequest,
        resumed: common_pb2.Resumed | None,
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        result, prefill = await self._prefill(request, rid, route, resumed)
        first = result.first
        if first.finish_reason:
            yield first
            return
        decode = _decode_request(request, rid, result, resumed)
        first.ClearField("usage")  # clients get usage on the last chunk only
        try:  # a client gone right after the first token must release the lease too
            yield first
            async for chunk in self._stream("decode", decode, route):
                yield chunk
        finally:  # a no-op once a decode worker pulled it; frees it when none did
            await self._release(prefill, result.kv_handle.transfer_id)

    async def _route_request(
        self, request: scheduler_pb2.GenerateRequest, rid: str
    ) -> RouteRequest:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise Failed(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        k = request.resumed.num_output_tokens
        if k >= n:
            raise Failed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resumed.num_output_tokens is {k}; "
                f"it must be less than the {n} prompt tokens it is part of",
            )
        try:
            params = convert.sampling_params_from_pb(request.sampling_params)
        except ValueError as e:
            raise Failed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if not self._entry_workers():
            await self.view.refresh()  # the view is refresh_s old: a worker may have just joined
        if not self._entry_workers():
            raise Failed(
                grpc.StatusCode.UNAVAILABLE, "no prefill or aggregated worker is registered"
            )
        limit = self.view.max_model_len()
        if n + (params.max_tokens or 0) > limit or n >= limit:
            raise Failed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"limit of {limit} tokens",
            )
        entry = self._entry_workers()[0].record
        block_size = entry.block_size or 1
        hashes: tuple[int, ...] = ()
        if self.policy.uses_prefixes:
            # what a worker's prefix cache would match (all but the last token), salted as the
            # workers salt their hashes: with the model's fingerprint
            salt = entry.model_fingerprint.encode()
            hashes = tuple(prefix_hashes(request.prompt_token_ids[: n - 1], block_size, salt))
        return RouteRequest(rid, n, -(-n // block_size), block_size, hashes)

    def _entry_workers(self) -> list[WorkerView]:
        """The workers a request can start on: aggregated ones first, then prefill ones."""
        return self.view.workers("aggregated") + self.view.workers("prefill")

    async def _prefill(
        self,
        request: scheduler_pb2.GenerateRequest,
        rid: str,
        route: RouteRequest,
        resumed: common_pb2.Resumed | None,
    ) -> tuple[prefill_worker_pb2.PrefillResult, WorkerRecord]:
        msg = prefill_worker_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            resumed=resumed,
        )
        tried: dict[str, Failed] = {}
        for attempt in range(self.config.max_attempts):
            cand = await self._pick("prefill", tried, route)
            stub = prefill_worker_pb2_grpc.PrefillWorkerStub(self.channel(cand.record))
            call = stub.Prefill(msg)
            try:
                with (
                    self.view.routed(cand.worker_id, tokens=route.num_prompt_tokens),
                    self._cut_if_gone(cand.record, call) as gone,
                ):
                    try:
                        return await call, cand.record
                    except asyncio.CancelledError:
                        if not _was_cut(gone):
                            raise
                        raise _gone_error("prefill", cand.worker_id) from None
            except grpc.aio.AioRpcError as e:
                tried[cand.worker_id] = await self._after_failure(
                    "prefill", cand, e, attempt, False
                )
        raise AssertionError("unreachable: the last attempt raises")

    async def _stream(
        self, role: str, msg: decode_worker_pb2.DecodeRequest, route: RouteRequest
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        """Stream ``msg``'s Decode from a worker of ``role`` (decode: the KV waits under its
        lease; aggregated: it prefills too). A worker that refuses or is down before it sent
        anything is replaced by another."""
        tokens = route.num_prompt_tokens if role == "aggregated" else 0
        tried: dict[str, Failed] = {}
        for attempt in range(self.config.max_attempts):
            cand = await self._pick(role, tried, route)
            stub = decode_worker_pb2_grpc.DecodeWorkerStub(self.channel(cand.record))
            call = stub.Decode(msg)
            streamed = False
            try:
                with (
                    self.view.routed(cand.worker_id, tokens=tokens, blocks=route.num_blocks + 1),
                    self._cut_if_gone(cand.record, call) as gone,
                ):
                    try:
                        async for chunk in call:
                            streamed = True
                            yield chunk
                    except asyncio.CancelledError:
                        if not _was_cut(gone):
                            raise
                        raise _gone_error(role, cand.worker_id) from None
                return
            except grpc.aio.AioRpcError as e:
                tried[cand.worker_id] = await self._after_failure(role, cand, e, attempt, streamed)
            finally:
                call.cancel()  # a no-op when the stream has ended

    @contextlib.contextmanager
    def _cut_if_gone(self, worker: WorkerRecord, call: grpc.aio.Call) -> Iterator[asyncio.Event]:
        """Cancel ``call`` if ``worker`` leaves the registry meanwhile: a worker that hangs, or
        whose host is gone without closing the connection, would otherwise keep the request
        waiting for as long as it may run. The event says it was cut (see _was_cut)."""
        with self.view.watch(worker) as gone:

            async def cut() -> None:
                await gone.wait()
                call.cancel()

            cutter = asyncio.create_task(cut())
            try:
                yield gone
            finally:
                cutter.cancel()

    async def _pick(self, role: str, tried: dict[str, Failed], route: RouteRequest) -> Candidate:
        hashes = route.block_hashes if role != "decode" else ()
        cands = self.view.candidates(role, tried, hashes)
        if not cands and not tried:  # the view is refresh_s old: a worker may have just joined
            await self.view.refresh()
            cands = self.view.candidates(role, tried, hashes)
        if not cands:
            if tried:  # every worker failed: the last failure says why
                raise list(tried.values())[-1]
            raise Failed(grpc.StatusCode.UNAVAILABLE, f"no {role} worker is registered")
        pick = {
            "prefill": self.policy.pick_prefill,
            "decode": self.policy.pick_decode,
            "aggregated": self.policy.pick_aggregated,
        }[role]
        chosen = pick(cands, route)
        metrics.EXPECTED_CACHED_TOKENS.inc(chosen.cached_blocks * route.block_size)
        return chosen

    async def _after_failure(
        self, stage: str, cand: Candidate, e: grpc.aio.AioRpcError, attempt: int, streamed: bool
    ) -> Failed:
        """Raise Failed unless the call may be retried on another worker; else back off and
        return the failure (raised when no other worker is left)."""
        code = e.code()
        kv_error = any(k == KV_ERROR_KEY for k, _ in (e.trailing_metadata() or ()))
        where = f"{stage} worker {cand.worker_id}"
        if code == grpc.StatusCode.UNAVAILABLE and not kv_error:  # down or going away: route
            self.view.suspect(cand.worker_id)  # around it, a retry's and a migration's next pick
        if streamed or kv_error or code not in RETRYABLE:
            raise Failed(code, f"{where}: {e.details()}")
        if attempt + 1 == self.config.max_attempts:
            raise Failed(code, f"{where} (attempt {attempt + 1}, the last): {e.details()}")
        log.info("retrying", stage=stage, worker=cand.worker_id, code=code.name)
        metrics.RETRIES.labels(stage).inc()
        await asyncio.sleep(self.config.retry_backoff_s * 2**attempt)
        return Failed(code, f"{where}: {e.details()}")

    async def _release(self, prefill: WorkerRecord, transfer_id: str) -> None:
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(self.channel(prefill))
        req = prefill_worker_pb2.ReleaseRequest(transfer_id=transfer_id)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.shield(stub.Release(req, timeout=2.0))

    def status(self) -> scheduler_pb2.ClusterStatusReply:
        reply = scheduler_pb2.ClusterStatusReply(
            cluster=self.config.service.cluster, routing_policy=self.policy.name
        )
        for view in self.view.workers():
            reply.workers.append(_worker_status(view))
        return reply


def _was_cut(gone: asyncio.Event) -> bool:
    """A CancelledError came from _cut_if_gone, not from this task being cancelled."""
    task = asyncio.current_task()
    return gone.is_set() and not (task is not None and task.cancelling())


def _gone_error(stage: str, worker_id: str) -> grpc.aio.AioRpcError:
    """A call cut under _cut_if_gone fails UNAVAILABLE, as if its connection had dropped: it
    is retried, or moved, like one."""
    why = f"{stage} worker {worker_id} left the registry (no heartbeat) while serving this call"
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=why
    )


def _decode_request(
    request: scheduler_pb2.GenerateRequest,
    rid: str,
    result: prefill_worker_pb2.PrefillResult,
    resumed: common_pb2.Resumed | None,
) -> decode_worker_pb2.DecodeRequest:
    """The Decode that continues a prefill: its first token and the handle of its KV."""
    first = result.first
    params = common_pb2.SamplingParams()
    params.CopyFrom(request.sampling_params)
    params.ClearField("prompt_logprobs")  # the prefill worker sent them with the first token
    return decode_worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=params,
        first_token_id=first.token_ids[0],
        first_logprobs=first.logprobs[0] if first.logprobs else None,
        kv_handle=result.kv_handle,
        num_cached_tokens=first.usage.cached_tokens,
        resumed=resumed,
    )


def _worker_status(view: WorkerView) -> scheduler_pb2.WorkerStatus:
    r = view.record
    info = common_pb2.WorkerInfo(
        worker_id=r.worker_id,
        role=r.role,
        address=r.address,
        kv_address=r.kv_address,
        kv_transport=r.kv_transport,
        model=r.model,
        model_fingerprint=r.model_fingerprint,
        max_model_len=r.max_model_len,
        block_size=r.block_size,
        num_kv_blocks=r.num_kv_blocks,
        metrics_port=r.metrics_port,
        dep_group=r.dep_group,
        dep_rank=r.dep_rank,
        pid=r.pid,
        started_at=r.started_at,
    )
    out = scheduler_pb2.WorkerStatus(info=info)
    if view.load is not None:
        ld = view.load
        out.load.CopyFrom(
            common_pb2.LoadReport(
                running=ld.running,
                waiting=ld.waiting,
                queued_prefill_tokens=ld.queued_prefill_tokens,
                free_kv_blocks=ld.free_kv_blocks,
                total_kv_blocks=ld.total_kv_blocks,
                cached_kv_blocks=ld.cached_kv_blocks,
                step_time_s=ld.step_time_s,
                updated_at=ld.updated_at,
            )
        )
    return out


class _Servicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        s = self.scheduler
        rid = request.request_id or uuid.uuid4().hex
        if rid in s._active:
            await abort_with(context, grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running")
        task = asyncio.current_task()
        assert task is not None
        s._active[rid] = task
        metrics.RUNNING.inc()
        outcome = "cancelled"
        with bind_request(rid):
            try:
                async for chunk in s.generate(request, rid):
                    yield chunk
                outcome = "ok"
            except Failed as f:
                outcome = f.code.name.lower()
                await abort_with(context, f.code, f.message)
            finally:
                s._active.pop(rid, None)
                metrics.RUNNING.dec()
                metrics.REQUESTS.labels(outcome).inc()

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortReply:
        task = self.scheduler._active.get(request.request_id)
        if task is not None:
            task.cancel()
        return common_pb2.AbortReply(found=task is not None)

    async def ClusterStatus(
        self, request: scheduler_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ClusterStatusReply:
        await self.scheduler.view.refresh()
        return self.scheduler.status()
