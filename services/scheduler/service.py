"""Scheduler over gRPC: ``Generate`` serves one request on the cluster's workers.

A request's path is one loop over attempts (``Scheduler.generate``). An attempt is one call to
one worker, at one stage of the request:

- ``aggregated``: Decode without a KV handle on an aggregated worker, which prefills and decodes;
- ``prefill``: Prefill on a prefill worker, which answers with the first token and a KV handle;
  the first token streams at once (that is the time to first token);
- ``decode``: Decode with that handle on a decode worker, which pulls the KV and streams the rest.

A call that fails becomes a ``Failure`` (a value), and ``next_step`` decides what follows:

- ``RETRY``: it failed before it streamed anything in a way another worker may not (UNAVAILABLE,
  RESOURCE_EXHAUSTED), and the stage has attempts left: the same stage on another worker, after
  a backoff. A decode retry pulls the same KV: it waits under its lease on the prefill worker.
- ``FALL_BACK``: no aggregated worker took the request before streaming, and prefill workers
  are registered: prefill then decode. A mixed cluster fills its aggregated workers first and
  spills over to P/D pairs.
- ``MIGRATE``: tokens were streamed and the worker went away (UNAVAILABLE, ABORTED, CANCELLED,
  DEADLINE_EXCEEDED), and ``migration_limit`` allows another move: the request goes on from where
  it was, as a request whose prompt holds what it generated (``Streamed.move``; Dynamo's request
  migration), from the first stage again.
- ``FAIL``: the Generate ends with the call's status and message.

Aggregated workers come first whenever one is registered. Cancelling ``Generate`` (or ``Abort``)
cancels the call in flight, which aborts the request on its worker, and releases a lease no
decode worker pulled. A worker whose registry record expires while it serves a call (it hung, or
its host went away) has that call cut, which then fails UNAVAILABLE like a crash's. No request
state goes to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from ferry.protos import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from ferry.services.common import convert, tasks, tracing
from ferry.services.common.channels import ChannelPool
from ferry.services.common.cluster_state import LoadReport, WorkerRecord, WorkerView
from ferry.services.common.convert import KV_ERROR_KEY
from ferry.services.common.log import bind_request, get_logger
from ferry.services.common.prefix_hash import prefix_hashes
from ferry.services.common.server import RegisteredService, abort_with
from ferry.services.common.streamed import Streamed
from ferry.services.scheduler import metrics
from ferry.services.scheduler.cluster_view import ClusterView
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.policies import Candidate, RouteRequest, create_policy
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


class Failed(Exception):
    """End the Generate with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Failure:
    """How one worker call failed."""

    stage: str  # aggregated | prefill | decode
    worker_id: str  # "" when no worker of the stage was left to call
    code: grpc.StatusCode
    details: str
    attempt: int = 0  # of the stage, from 0
    streamed: bool = False  # the call had streamed chunks when it failed
    kv_error: str = ""  # why a Decode's KV pull failed on the exporter's side ("": it did not)

    @classmethod
    def of(cls, stage: str, worker_id: str, e: grpc.aio.AioRpcError, **kw: object) -> Failure:
        reasons = [str(v) for k, v in (e.trailing_metadata() or ()) if k == KV_ERROR_KEY]
        kv_error = reasons[0] if reasons else ""
        return cls(stage, worker_id, e.code(), e.details() or "", kv_error=kv_error, **kw)  # type: ignore[arg-type]

    @property
    def message(self) -> str:
        if not self.worker_id:  # none was left to call
            return self.details
        nth = f" (attempt {self.attempt + 1})" if self.attempt else ""
        return f"{self.stage} worker {self.worker_id}{nth}: {self.details}"


class Step(enum.Enum):
    RETRY = "retry"  # the same stage on another worker
    FALL_BACK = "fall_back"  # prefill then decode, after no aggregated worker took it
    MIGRATE = "migrate"  # go on from what was streamed, from the first stage
    FAIL = "fail"  # end the Generate with the failure's status


def next_step(
    f: Failure, *, max_attempts: int, others_left: bool, can_fall_back: bool, can_move: bool
) -> Step:
    """What follows a failed call. ``others_left``: the stage has untried workers;
    ``can_fall_back``: prefill workers are registered; ``can_move``: the request has streamed
    tokens and may move again (its migration limit)."""
    retryable = f.code in RETRYABLE and not f.streamed and not f.kv_error
    if retryable and others_left and f.attempt + 1 < max_attempts:
        return Step.RETRY
    if f.stage == "aggregated" and retryable and can_fall_back:
        return Step.FALL_BACK
    # a lease that is gone (expired, or pulled by an earlier attempt that failed after it): only
    # a new prefill brings the KV back
    if can_move and (f.code in MIGRATABLE or f.kv_error == "not_found"):
        return Step.MIGRATE
    return Step.FAIL


@dataclass
class _Lease:
    """A prefill's KV under its lease on the prefill worker, until a decode worker pulls it."""

    worker: WorkerRecord
    result: prefill_worker_pb2.PrefillResult


class Scheduler(RegisteredService):
    role = "scheduler"
    service_names = ("ferry.v1.Scheduler",)

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config.service, self.load_report)
        self.config = config
        self.view = ClusterView(self.cluster, config.refresh_s, suspect_s=config.service.ttl_s)
        self.policy = create_policy(config.routing_policy)
        self._channels = ChannelPool()
        self._active: dict[str, asyncio.Task[object]] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(_Servicer(self), server)

    def load_report(self) -> LoadReport:
        """What each heartbeat writes beside the record: the requests this scheduler serves."""
        return LoadReport(running=len(self._active), updated_at=time.time())

    async def start(self, address: str, metrics_port: int) -> None:
        await super().start(address, metrics_port)
        await self.view.refresh()
        self._refresher = asyncio.create_task(self.view.run())
        if self.policy.uses_prefixes:
            self._follower = asyncio.create_task(follow(self.cluster, self.view.prefix))

    async def close(self) -> None:
        for task in (self._refresher, self._follower):
            await tasks.stop(task)
        await self._channels.close()
        await super().close()

    def channel(self, worker: WorkerRecord) -> grpc.aio.Channel:
        return self._channels.get(worker.address, worker.process)

    # ---- one request ----------------------------------------------------------------------
    async def generate(
        self, request: scheduler_pb2.GenerateRequest, rid: str, span: Span = trace.INVALID_SPAN
    ) -> AsyncGenerator[common_pb2.TokenChunk, None]:
        """The request's chunks, under ``rid``; Failed (a status and message) when it cannot be
        served. The loop over attempts is described in the module's docstring; each attempt
        is a child span of ``span``, each retry, fall-back and move an event of it."""
        route = await self._route_request(request, rid)
        started = time.perf_counter()
        sent = Streamed.after(request)
        part = request  # what the workers are asked for: the request, or its rest after a move
        part_id = rid  # the workers' id of the part: a move's old part may linger on its worker
        stage = self._first_stage()
        tried: dict[str, Failure] = {}  # this stage's failed workers
        lease: _Lease | None = None
        try:
            while True:
                cand = await self._pick(stage, tried, route)
                if cand is None:
                    failure = self._none_left(stage, tried)
                elif stage == "prefill":
                    if not tried:
                        metrics.PATHS.labels("disaggregated").inc()
                    prefilled = await self._prefill(
                        cand, part, part_id, route, _Attempt(len(tried), sent.moves, span)
                    )
                    if isinstance(prefilled, _Lease):
                        lease = prefilled
                        first = common_pb2.TokenChunk()
                        first.CopyFrom(lease.result.first)
                        if not first.finish_reason:
                            first.ClearField("usage")  # clients get usage on the last chunk only
                        yield self._relay_chunk(first, rid, sent, request, started)
                        if first.finish_reason:
                            return
                        stage, tried = "decode", {}
                        continue
                    failure = prefilled
                else:
                    msg = self._decode_request(stage, part, part_id, lease)
                    call = _Call(self, stage, cand, _Attempt(len(tried), sent.moves, span))
                    async with contextlib.aclosing(call.chunks(msg, route)) as chunks:
                        async for chunk in chunks:
                            yield self._relay_chunk(chunk, rid, sent, request, started)
                            if chunk.finish_reason:
                                return  # what fails after the last chunk is not the client's
                    if call.failure is None:
                        return
                    failure = call.failure
                step = await self._decide_next_step(failure, tried, sent)
                span.add_event(step.value, {"stage": stage, "reason": failure.message})
                if step is Step.RETRY:
                    tried[failure.worker_id] = failure
                    log.info(
                        "retrying", stage=stage, worker=failure.worker_id, code=failure.code.name
                    )
                    metrics.RETRIES.labels(stage).inc()
                    await asyncio.sleep(self.config.retry_backoff_s * 2**failure.attempt)
                elif step is Step.FALL_BACK:
                    log.info(
                        "no aggregated worker took the request; prefill then decode",
                        code=failure.code.name,
                    )
                    stage, tried = "prefill", {}
                elif step is Step.MIGRATE:
                    await self._release(lease, span)
                    lease = None
                    part = sent.move(request, rid, "m")
                    part_id = part.request_id
                    log.warning(
                        "migrating",
                        reason=failure.message,
                        code=failure.code.name,
                        generated=len(sent.token_ids),
                        migration=sent.moves,
                    )
                    metrics.MIGRATIONS.inc()
                    route = await self._route_request(part, rid)
                    stage, tried = self._first_stage(), {}
                else:
                    raise Failed(failure.code, failure.message)
        finally:  # a no-op once a decode worker pulled it; frees it when none did
            await self._release(lease, span)
            span.set_attributes({"output_tokens": len(sent.token_ids), "migrations": sent.moves})

    async def _decide_next_step(
        self, failure: Failure, tried: dict[str, Failure], sent: Streamed
    ) -> Step:
        """After ``failure``: retry elsewhere, fall back, move the stream, or fail."""
        if (
            failure.code == grpc.StatusCode.UNAVAILABLE
            and failure.worker_id
            and not failure.kv_error
        ):
            self.view.suspect(failure.worker_id)  # down or going away: the next picks avoid it
        excluded = {*tried, failure.worker_id}
        others = self.view.candidates(failure.stage, excluded)
        if not others and failure.code in RETRYABLE:
            # the registry may have moved on since the last periodic read (a worker that left
            # was all this view knew, one that joined is not in it yet): read it before failing
            await self.view.refresh()
            others = self.view.candidates(failure.stage, excluded)
        return next_step(
            failure,
            max_attempts=self.config.max_attempts,
            others_left=bool(others),
            can_fall_back=bool(self.view.workers("prefill")),
            can_move=sent.can_move(self.config.migration_limit),
        )

    def _relay_chunk(
        self,
        chunk: common_pb2.TokenChunk,
        rid: str,
        sent: Streamed,
        request: scheduler_pb2.GenerateRequest,
        started: float,
    ) -> common_pb2.TokenChunk:
        """A worker's chunk as the client sees it: under the request's id; the last one with the
        whole request's usage (a moved request's workers saw only their part)."""
        if not sent.token_ids:
            metrics.TTFT.observe(time.perf_counter() - started)
        sent.forward(chunk, rid)
        metrics.GENERATED_TOKENS.inc(len(chunk.token_ids))
        if chunk.finish_reason:
            if request.HasField("resumed") or sent.moves:
                sent.count_usage(chunk.usage, request)
            metrics.PROMPT_TOKENS.inc(chunk.usage.prompt_tokens)
            metrics.CACHED_TOKENS.inc(chunk.usage.cached_tokens)
        return chunk

    def _first_stage(self) -> str:
        return "aggregated" if self.view.workers("aggregated") else "prefill"

    async def _route_request(
        self, request: scheduler_pb2.GenerateRequest, rid: str
    ) -> RouteRequest:
        """What the routing policy needs of a request, after checking it: Failed with
        INVALID_ARGUMENT for a request no worker could serve, UNAVAILABLE when none is up."""
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

    async def _pick(
        self, stage: str, tried: dict[str, Failure], route: RouteRequest
    ) -> Candidate | None:
        """The policy's worker for ``stage`` among those not tried yet; None when none is left."""
        hashes = route.block_hashes if stage != "decode" else ()
        cands = self.view.candidates(stage, tried, hashes)
        if not cands and not tried:  # the view is refresh_s old: a worker may have just joined
            await self.view.refresh()
            cands = self.view.candidates(stage, tried, hashes)
        if not cands:
            return None
        pick = {
            "prefill": self.policy.pick_prefill,
            "decode": self.policy.pick_decode,
            "aggregated": self.policy.pick_aggregated,
        }[stage]
        chosen = pick(cands, route)
        metrics.EXPECTED_CACHED_TOKENS.inc(chosen.cached_blocks * route.block_size)
        return chosen

    def _none_left(self, stage: str, tried: dict[str, Failure]) -> Failure:
        """The failure when no worker of ``stage`` is left: the last one's, if any was tried."""
        if tried:
            last = list(tried.values())[-1]
            return Failure(stage, "", last.code, last.message, attempt=self.config.max_attempts)
        return Failure(stage, "", grpc.StatusCode.UNAVAILABLE, f"no {stage} worker is registered")

    async def _prefill(
        self,
        cand: Candidate,
        part: scheduler_pb2.GenerateRequest,
        part_id: str,
        route: RouteRequest,
        attempt: _Attempt,
    ) -> _Lease | Failure:
        """The prefill's first token and KV handle, or how the call failed."""
        msg = prefill_worker_pb2.PrefillRequest(
            request_id=part_id,
            prompt_token_ids=part.prompt_token_ids,
            sampling_params=part.sampling_params,
            resumed=part.resumed if part.HasField("resumed") else None,
        )
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(self.channel(cand.record))
        with attempt.span("prefill", cand.worker_id) as span:
            call = stub.Prefill(msg, metadata=tracing.outgoing(span))
            outcome = await self._await_prefill(cand, call, route, attempt.number)
            span.set_attribute("outcome", _outcome(outcome))
            return outcome

    async def _await_prefill(
        self,
        cand: Candidate,
        call: grpc.aio.UnaryUnaryCall,
        route: RouteRequest,
        attempt: int,
    ) -> _Lease | Failure:
        with (
            self.view.routed(cand.worker_id, tokens=route.num_prompt_tokens),
            self._cut_if_gone(cand.record, call) as gone,
        ):
            try:
                return _Lease(cand.record, await call)
            except grpc.aio.AioRpcError as e:
                return Failure.of("prefill", cand.worker_id, e, attempt=attempt)
            except asyncio.CancelledError:
                if not _was_cut(gone):
                    raise
                return _gone("prefill", cand.worker_id, attempt, streamed=False)

    def _decode_request(
        self,
        stage: str,
        part: scheduler_pb2.GenerateRequest,
        part_id: str,
        lease: _Lease | None,
    ) -> decode_worker_pb2.DecodeRequest:
        """An aggregated worker's Decode (it prefills too), or the Decode that continues a
        prefill: its first token and the handle of its KV."""
        resumed = part.resumed if part.HasField("resumed") else None
        if stage == "aggregated" or lease is None:
            return decode_worker_pb2.DecodeRequest(
                request_id=part_id,
                prompt_token_ids=part.prompt_token_ids,
                sampling_params=part.sampling_params,
                resumed=resumed,
            )
        first = lease.result.first
        params = common_pb2.SamplingParams()
        params.CopyFrom(part.sampling_params)
        params.ClearField("prompt_logprobs")  # the prefill worker sent them with the first token
        return decode_worker_pb2.DecodeRequest(
            request_id=part_id,
            prompt_token_ids=part.prompt_token_ids,
            sampling_params=params,
            first_token_id=first.token_ids[0],
            first_logprobs=first.logprobs[0] if first.logprobs else None,
            kv_handle=lease.result.kv_handle,
            num_cached_tokens=lease.result.first.usage.cached_tokens,
            resumed=resumed,
        )

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

    async def _release(self, lease: _Lease | None, span: Span) -> None:
        """Free a prefill's KV that no decode worker pulled (a no-op once one has)."""
        if lease is None:
            return
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(self.channel(lease.worker))
        req = prefill_worker_pb2.ReleaseRequest(transfer_id=lease.result.kv_handle.transfer_id)
        call = stub.Release(req, timeout=2.0, metadata=tracing.outgoing(span))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.shield(call)

    def status(self) -> scheduler_pb2.ClusterStatusReply:
        reply = scheduler_pb2.ClusterStatusReply(
            cluster=self.config.service.cluster, routing_policy=self.policy.name
        )
        for view in self.view.workers():
            reply.workers.append(_worker_status(view))
        return reply


@dataclass(frozen=True)
class _Attempt:
    """Which attempt a worker call is: its number in its stage (from 0), the moves before it,
    and the request's span, which its own span is a child of."""

    number: int
    migration: int
    parent: Span

    def span(self, stage: str, worker_id: str) -> contextlib.AbstractContextManager[Span]:
        return tracing.span("attempt", self.parent, **self._attributes(stage, worker_id))

    def start(self, stage: str, worker_id: str) -> Span:
        """The attempt's span, open until the caller ends it (a stream's own finally)."""
        return tracing.start("attempt", self.parent, **self._attributes(stage, worker_id))

    def _attributes(self, stage: str, worker_id: str) -> dict[str, object]:
        return {
            "stage": stage,
            "worker": worker_id,
            "attempt": self.number,
            "migration": self.migration,
        }


def _outcome(result: _Lease | Failure | None) -> str:
    """An attempt's outcome in its span: ok, or the status it failed with."""
    return result.code.name if isinstance(result, Failure) else "ok"


class _Call:
    """One Decode stream from one worker: its chunks, then how it ended (``failure``: None when
    the stream finished)."""

    def __init__(
        self, scheduler: Scheduler, stage: str, cand: Candidate, attempt: _Attempt
    ) -> None:
        self.scheduler = scheduler
        self.stage = stage
        self.cand = cand
        self.attempt = attempt
        self.failure: Failure | None = None

    async def chunks(
        self, msg: decode_worker_pb2.DecodeRequest, route: RouteRequest
    ) -> AsyncGenerator[common_pb2.TokenChunk, None]:
        s, cand, attempt = self.scheduler, self.cand, self.attempt.number
        span = self.attempt.start(self.stage, cand.worker_id)
        stub = decode_worker_pb2_grpc.DecodeWorkerStub(s.channel(cand.record))
        call = stub.Decode(msg, metadata=tracing.outgoing(span))
        # an aggregated worker computes the prompt too; either holds its blocks (+1 to grow)
        tokens = route.num_prompt_tokens if self.stage == "aggregated" else 0
        streamed = False
        try:
            with (
                s.view.routed(cand.worker_id, tokens=tokens, blocks=route.num_blocks + 1),
                s._cut_if_gone(cand.record, call) as gone,
            ):
                try:
                    async for chunk in call:
                        if not streamed and self.stage == "aggregated":
                            metrics.PATHS.labels("aggregated").inc()
                        streamed = True
                        yield chunk
                except grpc.aio.AioRpcError as e:
                    self.failure = Failure.of(
                        self.stage, cand.worker_id, e, attempt=attempt, streamed=streamed
                    )
                except asyncio.CancelledError:
                    if not _was_cut(gone):
                        raise
                    self.failure = _gone(self.stage, cand.worker_id, attempt, streamed)
        finally:
            call.cancel()  # a no-op when the stream has ended
            span.set_attribute("outcome", _outcome(self.failure))
            span.end()


def _was_cut(gone: asyncio.Event) -> bool:
    """A CancelledError came from _cut_if_gone, not from this task being cancelled."""
    task = asyncio.current_task()
    return gone.is_set() and not (task is not None and task.cancelling())


def _gone(stage: str, worker_id: str, attempt: int, streamed: bool) -> Failure:
    """A call cut under _cut_if_gone fails UNAVAILABLE, as if its connection had dropped: it
    is retried, or moved, like one."""
    why = "left the registry (no heartbeat) while serving this call"
    return Failure(stage, worker_id, grpc.StatusCode.UNAVAILABLE, why, attempt, streamed)


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
        with (
            bind_request(rid),
            tracing.span(
                "generate",
                tracing.incoming(context),
                request_id=rid,
                prompt_tokens=len(request.prompt_token_ids),
            ) as span,
        ):
            try:
                # closed here, not whenever it is collected: its finally (the lease's release,
                # the span's last attributes) runs before the span ends, even when the client
                # hangs up after the last chunk
                async with contextlib.aclosing(s.generate(request, rid, span)) as chunks:
                    async for chunk in chunks:
                        if chunk.finish_reason:  # served: a client that hangs up now loses nothing
                            outcome = "ok"
                        yield chunk
                outcome = "ok"
            except Failed as f:
                outcome = f.code.name.lower()
                await abort_with(context, f.code, f.message)
            finally:
                s._active.pop(rid, None)
                metrics.RUNNING.dec()
                metrics.REQUESTS.labels(outcome).inc()
                span.set_attribute("outcome", outcome)

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
