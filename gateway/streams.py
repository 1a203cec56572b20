"""n choices of one request as n scheduler streams, merged into one stream of (index, chunk),
with the latency metrics a client would measure."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway import metrics
from gateway.backend import Backend, for_choice
from protos import common_pb2


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, chunk: common_pb2.TokenChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.cached_tokens = chunk.usage.cached_tokens


def usage(choices: list[Choice], num_prompt_tokens: int) -> dict[str, object]:
    completion = sum(len(c.token_ids) for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


async def merged(
    backend: Backend, prompt_ids: list[int], params: common_pb2.SamplingParams, n: int
) -> AsyncIterator[tuple[int, common_pb2.TokenChunk]]:
    """Every choice's chunks as they arrive. The first error of any choice ends the whole
    request (the others are cancelled); leaving the iterator early cancels them all."""
    started = time.perf_counter()
    rid = uuid.uuid4().hex
    queue: asyncio.Queue[tuple[int, common_pb2.TokenChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for chunk in backend.generate(prompt_ids, for_choice(params, i), f"{rid}-{i}"):
                await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as e:  # any failure of one choice is handed to the reader
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(n)]
    last = [0.0] * n
    running = n
    try:
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            now = time.perf_counter()
            if last[i] == 0.0:
                metrics.TTFT.observe(now - started)
            elif item.token_ids:
                metrics.ITL.observe((now - last[i]) / len(item.token_ids))
            last[i] = now
            metrics.COMPLETION_TOKENS.inc(len(item.token_ids))
            yield i, item
        metrics.E2E.observe(time.perf_counter() - started)
        metrics.PROMPT_TOKENS.inc(len(prompt_ids))
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
