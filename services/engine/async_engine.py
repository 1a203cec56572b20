"""AsyncEngine: the engine's step loop on one background thread, driven from asyncio.

Callers on the event loop submit requests and aborts; the thread applies them between steps and
hands each step's outputs back to the loop. The thread sleeps on a condition variable when there
is nothing to do (no spinning). A request whose consumer stops iterating is aborted.

The ``Engine`` is single-threaded and private to this class: the step thread builds it and is the
only thread that calls it. Building it there matters on the CPU. OpenMP (libgomp) gives every
thread that runs a parallel torch op a thread pool of its own. Once the pools' threads outnumber
the cores, its threads stop spinning at barriers and sleep instead. An engine built on the main
thread left that thread a pool, and every later step on this thread ran about twice as slow
(`loadtest/results/peer-llamacpp-before-step-thread.json` against `peer-llamacpp.json`). So no
other thread runs a parallel torch op.

What other threads may use is below, each safe for the reason given: the facts fixed at build
time (``info``), request validation (reads those facts), the KV cache tensor and the hold API
around it (``kv_holds``: the manager's lock; KV transfers), the prefix-cache events and the
expert load (their own locks), the EPLB ``rebalancer`` (a queue the step thread drains) and the
``load`` snapshot the step thread publishes after every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ferry.services.common.os_thread import name_this_thread
from ferry.services.common.sampling_params import SamplingParams
from ferry.services.common.tokenizer import Tokenizer
from ferry.services.engine.config import EngineConfig
from ferry.services.engine.engine import Engine, EngineLoad
from ferry.services.engine.expert_rebalance import Rebalancer
from ferry.services.engine.kv_cache import KvHolds
from ferry.services.engine.model.cache_spec import CacheSpec
from ferry.services.engine.request import ImportedKv, RequestOutput, Resumed

DEP_IDLE_POLL_S = 0.05  # an idle group's ranks check in 20 times a second (~3% of a core here)


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hand_off: bool = False
    imported: ImportedKv | None = None
    resumed: Resumed | None = None
    grammar: Any = None  # xgrammar's CompiledGrammar of params.structured_output


@dataclass(frozen=True)
class EngineInfo:
    """Facts about an engine, fixed when it is built."""

    model_fingerprint: str
    dtype: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    cache_spec: CacheSpec  # what the cache's blocks and state slots hold
    num_expert_groups: int  # the model's n_group, which EPLB places experts by


@dataclass(frozen=True)
class ExpertLoadSnapshot:
    """The expert load a worker publishes for the EPLB controller (see ExpertLoad)."""

    counts: list[list[int]]  # [num_moe_layers][num_experts] tokens routed over the window
    steps_total: int
    placement_version: int
    placement_step: int  # the group step at which that placement took effect
    snapshots: list[list[object]]  # [[group step, rows per MoE layer], ...]
    hash_layers: list[int]  # MoE layers routed by token id: their counts come from tokens


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


def _builder(source: EngineConfig | Engine | Callable[[], Engine] | None) -> Callable[[], Engine]:
    if isinstance(source, Engine):
        engine = source
        return lambda: engine
    if callable(source):
        return source
    return functools.partial(Engine, source)


class AsyncEngine:
    _engine: Engine
    _load: EngineLoad  # published by the step thread after every step

    def __init__(self, source: EngineConfig | Engine | Callable[[], Engine] | None = None) -> None:
        """``source``: what builds the engine on the step thread (an ``EngineConfig``, or a
        function that returns the ``Engine``), or an ``Engine`` built already (by a test: its
        builder's thread keeps an OpenMP pool, see above). Returns once the engine is built;
        raises what building it raised."""
        self._cv = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        # structured outputs' grammars compile here, not on the engine's thread
        self._grammars = ThreadPoolExecutor(1, thread_name_prefix="ferry-grammar")
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(_builder(source),), name="ferry-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            self._grammars.shutdown(wait=False)
            raise self._build_error
        engine = self._engine
        self.info = EngineInfo(
            engine.model_fingerprint,
            engine.config.dtype,
            engine.max_model_len,
            engine.kv.block_size,
            engine.kv.num_blocks,
            engine.model.cache_spec(),
            engine.model.config.n_group,
        )

    @property
    def error(self) -> BaseException | None:
        """Why the step loop died (it serves nothing more), or None while it runs."""
        with self._cv:
            return self._error

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """ValueError for a request that can never run here (it reads only fixed facts)."""
        self._engine.validate(prompt_token_ids, params)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.info.block_size)

    @property
    def kv_blocks(self) -> torch.Tensor:
        """The cache's blocks as KV transports move them, [layers, blocks, block_size, dim]:
        the blocks held under ``kv_holds`` are read and written through it (DeepSeek-V3's
        latent cache itself; V4's blocks as bytes, see V4KVCache.transfer)."""
        return self._engine.model.kv_blocks(self._engine.kv_cache)

    @property
    def kv_holds(self) -> KvHolds:
        return self._engine.kv

    def record_kv_events(self) -> None:
        """Keep prefix-cache events from now on, for :meth:`take_kv_events`."""
        self._engine.kv.record_events()

    def take_kv_events(self, snapshot: bool = False) -> list[tuple[bool, int]]:
        """(stored, block hash) since the last call; ``snapshot``: every hash held now."""
        return self._engine.kv.take_events(snapshot)

    def take_snapshot_events(self, snapshot: bool = False) -> list[tuple[bool, int]]:
        """The state-snapshot events since the last call (see KVCacheManager); thread-safe."""
        return self._engine.kv.take_snapshot_events(snapshot)

    @property
    def stateful(self) -> bool:
        """Whether a prefix hit here needs a state snapshot (the model keeps per-request state)."""
        return self._engine.kv.num_state_slots > 0

    def expert_load(self) -> ExpertLoadSnapshot:
        eng = self._engine
        load = eng.expert_load
        return ExpertLoadSnapshot(
            load.window().tolist(),
            load.steps_total,
            eng.rebalancer.version if eng.rebalancer else 0,
            eng.lockstep.placement_step if eng.lockstep else 0,
            load.recent_snapshots(),
            load.hash_layers,
        )

    @property
    def rebalancer(self) -> Rebalancer | None:
        """A DEP rank's EPLB orders go in here; the step thread applies them (None elsewhere)."""
        return self._engine.rebalancer

    @property
    def load(self) -> EngineLoad:
        """Requests as of the last step (those not yet admitted count as waiting) and the KV
        cache as it is now (leases come and go between steps)."""
        with self._cv:
            pending = len(self._adds)
        kv = self._engine.kv.usage()
        return dataclasses.replace(
            self._load,
            waiting=self._load.waiting + pending,
            free_kv_blocks=kv["free"] + kv["cached"],
            total_kv_blocks=kv["total"],
            cached_kv_blocks=kv["cached"],
        )

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        hand_off: bool = False,
        imported: ImportedKv | None = None,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput after every step that adds tokens; the last one is finished.
        Invalid requests raise ValueError before anything runs. ``hand_off``, ``imported`` and
        ``resumed`` are as in :meth:`Engine.add_request`."""
        async for outs in self.stream(
            prompt, params, request_id, hand_off=hand_off, imported=imported, resumed=resumed
        ):
            for out in outs:
                yield out

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        hand_off: bool = False,
        imported: ImportedKv | None = None,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        """Like :meth:`generate`, but yields every output that is ready at once: a reader that
        lags gets several steps' outputs in one list (to coalesce into one message)."""
        params = params or SamplingParams()
        ids = self._engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._engine.validate(ids, params)
        grammar = None
        if params.structured_output is not None:  # ValueError when it does not compile
            grammar = await asyncio.get_running_loop().run_in_executor(
                self._grammars, self._engine.grammars.compile, params.structured_output
            )
        rid = request_id or f"async-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._error is not None or self._stopped:
                raise EngineDeadError(f"engine is not running: {self._error or 'shut down'}")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already running")
            self._streams[rid] = stream
            self._adds.append(_Add(rid, ids, params, hand_off, imported, resumed, grammar))
            self._cv.notify()
        finished = False
        try:
            while not finished:
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                outs: list[RequestOutput] = []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    outs.append(item)
                finished = outs[-1].finished
                yield outs
        finally:
            if not finished:  # the consumer walked away: nobody reads this stream any more
                with self._cv:
                    self._streams.pop(rid, None)
                self._request_abort(rid)

    async def abort(self, request_id: str) -> None:
        self._request_abort(request_id)

    def _request_abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)
        self._grammars.shutdown(wait=False, cancel_futures=True)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self, build: Callable[[], Engine]) -> None:
        name_this_thread(self._thread.name)
        try:
            engine = build()
        except BaseException as e:  # the constructor raises it
            self._build_error = e
            self._built.set()
            return
        self._engine = engine
        self._load = engine.load()
        self._built.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (
                        self._stopped
                        or self._adds
                        or self._aborts
                        or self._engine.has_unfinished_requests()
                    ):
                        if self._engine.lockstep is not None:
                            # a DEP rank must join every step of its group, even idle. While
                            # another rank has work (the last step's collective said so) it
                            # steps again at once, or that rank would wait for it every step;
                            # once the whole group is idle it checks in at a slow cadence
                            if not self._engine.lockstep.group_busy:
                                self._cv.wait(DEP_IDLE_POLL_S)
                            break
                        self._cv.wait()
                    if self._stopped:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                self._apply(adds, aborts)
                outputs = self._engine.step()
                self._load = self._engine.load()  # before the streams hear of what it finished
                self._deliver_all(outputs)
        except BaseException as e:  # the engine is broken: fail every stream, then stop
            with self._cv:
                self._error = e
            self._fail_all(EngineDeadError(f"engine step failed: {e!r}"))
            raise
        self._fail_all(EngineDeadError("engine shut down"))

    def _apply(self, adds: list[_Add], aborts: list[str]) -> None:
        for a in adds:
            try:
                self._engine.add_request(
                    a.request_id,
                    a.prompt_token_ids,
                    a.params,
                    hand_off=a.hand_off,
                    imported=a.imported,
                    resumed=a.resumed,
                    grammar=a.grammar,
                )
            except (ValueError, KeyError) as e:
                self._deliver_error(a.request_id, e)
        for rid in aborts:
            out = self._engine.abort(rid)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        self._deliver_all([out])

    def _deliver_all(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not per output
        (64 running requests would otherwise cost 64 self-pipe writes per step)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._cv:
            for out in outs:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            # RuntimeError: the caller's event loop has closed, nobody is listening
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)

    def _deliver_error(self, rid: str, err: BaseException) -> None:
        with self._cv:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            self._put(stream, err)

    def _fail_all(self, err: BaseException) -> None:
        with self._cv:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._put(stream, err)

    @staticmethod
    def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's event loop has closed, nobody is listening
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _put_all(batch: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream.queue.put_nowait(out)
