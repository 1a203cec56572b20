"""AsyncEngine: the engine's step loop on one background thread, driven from asyncio.

Callers on the event loop submit requests and aborts; the thread applies them between steps and
hands each step's outputs back to the loop. The thread sleeps on a condition variable when there
is nothing to do (no spinning). A request whose consumer stops iterating is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.request import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, config: EngineConfig | Engine | None = None) -> None:
        self.engine = config if isinstance(config, Engine) else Engine(config)
        self._cv = threading.Condition()
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="ferry-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput after every step that adds tokens; the last one is finished.
        Invalid requests raise ValueError before anything runs."""
        params = params or SamplingParams()
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.validate(ids, params)
        rid = request_id or f"async-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._error is not None or self._stopped:
                raise EngineDeadError(f"engine is not running: {self._error or 'shut down'}")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already running")
            self._streams[rid] = stream
            self._adds.append((rid, ids, params))
            self._cv.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
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

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (
                        self._stopped
                        or self._adds
                        or self._aborts
                        or self.engine.has_unfinished_requests()
                    ):
                        self._cv.wait()
                    if self._stopped:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                self._apply(adds, aborts)
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # the engine is broken: fail every stream, then stop
            with self._cv:
                self._error = e
            self._fail_all(EngineDeadError(f"engine step failed: {e!r}"))
            raise
        self._fail_all(EngineDeadError("engine shut down"))

    def _apply(self, adds: list[tuple[str, list[int], SamplingParams]], aborts: list[str]) -> None:
        for rid, ids, params in adds:
            try:
                self.engine.add_request(rid, ids, params)
            except ValueError as e:
                self._deliver_error(rid, e)
        for rid in aborts:
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._cv:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is not None:
            self._put(stream, out)

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
