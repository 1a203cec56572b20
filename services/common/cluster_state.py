"""ClusterState: the worker registry and load reports in Redis (design.md §5).

Keys (prefix ``ferry:{cluster}:``): ``worker:{id}`` and ``load:{id}``, hashes that expire
``ttl_s`` after the last heartbeat. Every heartbeat re-writes both hashes in full, so a worker
that loses Redis (a restart, a network blip) re-registers by itself on the first beat that gets
through; a worker that dies leaves the registry when its keys expire.

``kv-events`` is a stream (capped at ``KV_EVENTS_MAXLEN`` entries) of the prefix-cache changes of
the workers that requests start on: each entry names a worker, whether to forget what it held
before (``cleared``: it just started, or lost events while Redis was away) and ``events``, block
hashes in hex, ``+`` stored and ``-`` removed, in order. Schedulers follow it to know which
worker holds which prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlparse

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ferry.services.common import tasks
from ferry.services.common.log import get_logger

log = get_logger(__name__)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
T = TypeVar("T")
KV_EVENTS_MAXLEN = 100_000


@dataclass(frozen=True)
class KvEvents:
    """One ``kv-events`` entry: ``worker_id``'s cache changes, in order. A worker whose model
    keeps per-request state (``stateful``: DeepSeek-V4) also reports its state snapshots, by
    the hash of the block they end: it serves a prefix hit only up to a block that has one."""

    worker_id: str
    events: list[tuple[bool, int]]  # (stored, block hash); False: removed
    cleared: bool = False  # the worker's cache was emptied before these events
    snapshots: list[tuple[bool, int]] = field(default_factory=list)  # (kept, block hash)
    stateful: bool = False

    def encode(self) -> dict[str, str]:
        return {
            "worker": self.worker_id,
            "cleared": "1" if self.cleared else "0",
            "events": _encode_events(self.events),
            "snapshots": _encode_events(self.snapshots),
            "stateful": "1" if self.stateful else "0",
        }

    @classmethod
    def decode(cls, fields: dict[str, str]) -> KvEvents:
        return cls(
            fields["worker"],
            _decode_events(fields.get("events", "")),
            fields.get("cleared") == "1",
            _decode_events(fields.get("snapshots", "")),
            fields.get("stateful") == "1",
        )


def _encode_events(events: list[tuple[bool, int]]) -> str:
    return " ".join(f"{'+' if stored else '-'}{h:x}" for stored, h in events)


def _decode_events(text: str) -> list[tuple[bool, int]]:
    return [(e[0] == "+", int(e[1:], 16)) for e in text.split()]


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: str  # "prefill" | "decode" | "scheduler"
    address: str  # host:port of its gRPC server
    kv_address: str = ""  # host:port of its KV transport endpoint ('' if none)
    kv_transport: str = ""
    model: str = ""
    model_fingerprint: str = ""
    max_model_len: int = 0
    block_size: int = 0
    num_kv_blocks: int = 0
    metrics_port: int = 0
    dep_group: str = ""
    dep_rank: int = -1
    pid: int = 0
    started_at: float = 0.0  # time.time()
    # stopping gracefully: takes nothing new, still serves what it has (and still beats, so a
    # worker that hangs while draining leaves the registry like any other)
    draining: bool = False

    @property
    def process(self) -> tuple[str, int, float]:
        """Which process this is: another one registered under the same id (restarted) differs."""
        return self.worker_id, self.pid, self.started_at


@dataclass(frozen=True)
class ExpertLoadReport:
    """What a DEP rank (or an independent worker) publishes every heartbeat for EPLB."""

    counts: list[list[int]]  # [num_moe_layers, num_experts] tokens routed over the window
    steps_total: int = 0
    placement_version: int = 0
    placement_step: int = 0  # the group step at which that placement took effect
    # [[group step, rows per MoE layer since start], ...]: the rows this rank's experts computed,
    # snapshotted at the same lockstep steps on every rank of a DEP group
    snapshots: list[list[Any]] = dataclasses.field(default_factory=list)
    # MoE layers routed by token id (DeepSeek-V4's hash layers): their counts are a slow
    # histogram of the tokens, and they are rebalanced less often
    hash_layers: list[int] = dataclasses.field(default_factory=list)
    updated_at: float = 0.0


@dataclass(frozen=True)
class LoadReport:
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0  # free plus cached (evictable) blocks
    total_kv_blocks: int = 0
    cached_kv_blocks: int = 0
    free_state_slots: int = 0  # a model with state (DeepSeek-V4): a slot per running request
    total_state_slots: int = 0
    step_time_s: float = 0.0
    updated_at: float = 0.0  # time.time() of the report


@dataclass(frozen=True)
class WorkerView:
    record: WorkerRecord
    load: LoadReport | None  # None when no load key exists (yet)


class ClusterStateError(RuntimeError):
    """Redis could not be reached when it had to be."""


def parse_redis_url(url: str) -> str:
    scheme = urlparse(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"redis url {url!r}: expected redis://host:port/db or unix:///path")
    return url


def _encode(obj: Any) -> dict[Any, Any]:  # redis' Mapping type is invariant in its keys
    return {k: str(v) for k, v in dataclasses.asdict(obj).items()}


def _decode(cls: type[T], raw: dict[str, str]) -> T:
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in raw:
            kind = type(f.default) if f.default is not dataclasses.MISSING else str
            kw[f.name] = raw[f.name] == "True" if kind is bool else kind(raw[f.name])
    return cls(**kw)


class ClusterState:
    def __init__(
        self,
        redis_url: str,
        cluster: str = "default",
        heartbeat_s: float = 1.0,
        ttl_s: float = 3.0,
    ) -> None:
        self.url = parse_redis_url(redis_url)
        self.cluster = cluster
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.redis = aioredis.from_url(
            redis_url, decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self._record: WorkerRecord | None = None
        self._load: Callable[[], LoadReport] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._healthy = False

    def key(self, *parts: str) -> str:
        return f"ferry:{self.cluster}:" + ":".join(parts)

    @property
    def healthy(self) -> bool:
        """The last heartbeat (or ping) reached Redis."""
        return self._healthy

    async def register(
        self, record: WorkerRecord, load: Callable[[], LoadReport] | None = None
    ) -> None:
        """Write the record (and load) now, then keep them alive every ``heartbeat_s``."""
        self._record, self._load = record, load
        try:
            await self._write()
        except REDIS_DOWN as e:
            raise ClusterStateError(f"cannot reach Redis at {self.url}: {e}") from e
        self._healthy = True
        self._beat = asyncio.create_task(self._heartbeat())

    async def _write(self) -> None:
        assert self._record is not None
        wid = self._record.worker_id
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key("worker", wid), mapping=_encode(self._record))
        pipe.pexpire(self.key("worker", wid), ttl_ms)
        if self._load is not None:
            pipe.hset(self.key("load", wid), mapping=_encode(self._load()))
            pipe.pexpire(self.key("load", wid), ttl_ms)
        await pipe.execute()

    async def _heartbeat(self) -> None:
        # Ends when deregister() clears the record, not only on cancel: redis-py (8.2) can
        # swallow a cancellation that lands inside a pipeline's execute, and the loop went on
        # writing the record while deregister() waited for it for ever (a failed DEP rank
        # stayed registered and never stopped).
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self._record is None:
                return
            try:
                await self._write()
            except REDIS_DOWN as e:
                if self._healthy:
                    log.warning(
                        "redis unreachable; heartbeats continue", url=self.url, error=str(e)
                    )
                self._healthy = False
                continue
            except Exception as e:  # a broken load() must not stop the heartbeat
                log.error("heartbeat failed", error=repr(e))
                continue
            if not self._healthy:
                log.info("re-registered", url=self.url)
            self._healthy = True

    async def drain(self) -> None:
        """Say that this worker takes nothing new (``WorkerRecord.draining``) and keep beating:
        schedulers stop routing to it but let the calls it serves run to their end; a worker
        that left the registry instead would have them cut as if it had hung."""
        if self._record is None:
            return
        self._record = dataclasses.replace(self._record, draining=True)
        with contextlib.suppress(*REDIS_DOWN):  # the next heartbeat writes it
            await self._write()
        log.info("draining", role=self._record.role)

    async def deregister(self) -> None:
        """Stop the heartbeat and delete the keys at once (Redis errors are ignored)."""
        record, self._record = self._record, None  # the heartbeat writes nothing more
        await tasks.stop(self._beat)  # a write in flight lands before the delete below
        self._beat = None
        if record is not None:
            wid = record.worker_id
            with contextlib.suppress(*REDIS_DOWN):
                await self.redis.delete(self.key("worker", wid), self.key("load", wid))

    async def workers(
        self, role: str | None = None, include_draining: bool = False
    ) -> list[WorkerView]:
        """Every live worker (of ``role``) that takes new work, sorted by worker id; with
        ``include_draining`` also those that are stopping (see :meth:`drain`).

        Raises ClusterStateError when Redis cannot be reached.
        """
        prefix = self.key("worker", "")
        try:
            keys = [k async for k in self.redis.scan_iter(match=prefix + "*", count=500)]
            if not keys:
                return []
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
                pipe.hgetall(self.key("load", k.removeprefix(prefix)))
            raw = await pipe.execute()
        except REDIS_DOWN as e:
            raise ClusterStateError(f"cannot reach Redis at {self.url}: {e}") from e
        views = []
        for rec, load in zip(raw[0::2], raw[1::2], strict=True):
            if not rec:  # expired between SCAN and HGETALL
                continue
            record = _decode(WorkerRecord, rec)
            if (role is None or record.role == role) and (include_draining or not record.draining):
                views.append(WorkerView(record, _decode(LoadReport, load) if load else None))
        return sorted(views, key=lambda v: v.record.worker_id)

    async def publish_expert_load(self, group: str, rank: int, report: ExpertLoadReport) -> None:
        """This rank's expert-load report under ``eplb:{group}:load`` (a hash, one field per
        rank, expiring with the heartbeat TTL) for the EPLB controller."""
        key = self.key("eplb", group, "load")
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, str(rank), json.dumps(dataclasses.asdict(report)))
        pipe.pexpire(key, int(self.ttl_s * 1000))
        await self._run(pipe.execute())

    async def expert_load(self, group: str) -> dict[int, list[list[int]]]:
        """Every rank's last published window of ``group``."""
        return {rank: r.counts for rank, r in (await self.expert_load_reports(group)).items()}

    async def expert_load_reports(self, group: str) -> dict[int, ExpertLoadReport]:
        raw = await self._run(self.redis.hgetall(self.key("eplb", group, "load")))
        names = {f.name for f in dataclasses.fields(ExpertLoadReport)}
        reports = {}
        for rank, value in raw.items():
            d = json.loads(value)
            reports[int(rank)] = ExpertLoadReport(**{k: v for k, v in d.items() if k in names})
        return reports

    async def save_placement(
        self, group: str, version: int, slot_to_logical: list[list[int]]
    ) -> None:
        """The placement a group runs (``eplb:{group}:placement``), for operators and tools (the
        ranks themselves are the truth: the controller asks them)."""
        value = json.dumps(
            {"version": version, "slot_to_logical": slot_to_logical, "updated_at": time.time()}
        )
        await self._run(self.redis.set(self.key("eplb", group, "placement"), value))

    async def placement(self, group: str) -> dict[str, Any] | None:
        """What ``save_placement`` last wrote for ``group`` (None: nothing)."""
        value = await self._run(self.redis.get(self.key("eplb", group, "placement")))
        return json.loads(value) if value else None

    async def forget_eplb_group(self, group: str) -> None:
        """Delete a gone group's ``eplb:{group}:*`` keys."""
        keys = [self.key("eplb", group, name) for name in ("load", "placement")]
        await self._run(self.redis.delete(*keys))

    async def publish_kv_events(self, batch: KvEvents) -> None:
        await self._run(
            self.redis.xadd(
                self.key("kv-events"),
                batch.encode(),  # type: ignore[arg-type]
                maxlen=KV_EVENTS_MAXLEN,
                approximate=True,
            )
        )

    async def read_kv_events(
        self, after: str, block_ms: int = 500, count: int = 1000
    ) -> tuple[str, list[KvEvents]]:
        """The ``kv-events`` entries after id ``after`` ("0" for all that are kept), waiting up
        to ``block_ms`` (under the client's 1 s socket timeout) for one; returns the last id
        read (``after`` when none) and them."""
        reply: Any = await self._run(
            self.redis.xread({self.key("kv-events"): after}, count=count, block=block_ms)
        )  # [[stream, [(id, fields), ...]]], or None when nothing came in block_ms
        batches = []
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                after = entry_id
                try:
                    batches.append(KvEvents.decode(fields))
                except (KeyError, ValueError, IndexError):  # not ours: skip it, read on
                    log.warning("malformed kv-events entry skipped", id=entry_id, fields=fields)
        return after, batches

    async def _run(self, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except REDIS_DOWN as e:
            raise ClusterStateError(f"cannot reach Redis at {self.url}: {e}") from e

    async def server_id(self) -> str:
        """The Redis server's run id: it changes when Redis restarts (and forgets every key)."""
        info = await self._run(self.redis.info("server"))
        return str(info.get("run_id", ""))

    async def ping(self) -> bool:
        try:
            self._healthy = bool(await self.redis.ping())
        except REDIS_DOWN:
            self._healthy = False
        return self._healthy

    async def close(self) -> None:
        await self.deregister()
        await self.redis.aclose()
