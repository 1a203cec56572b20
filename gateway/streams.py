"""The choices of one request (n per prompt; /v1/completions takes several prompts) as one
scheduler stream each, merged into one stream of (index, chunk), with the latency metrics a
client would measure."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import Span

from ferry.gateway import metrics
from ferry.gateway.backend import Backend, for_choice, request_span
from ferry.protos import common_pb2


@dataclass
class Choice:
    """What one choice has produced so far; ``prompt``: which of the request's prompts."""

    index: int
    prompt: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks: int = 0

    def add(self, chunk: common_pb2.TokenChunk) -> None:
        self.chunks += 1
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.prompt_logprobs += chunk.prompt_logprobs  # only the first chunk has them
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.cached_tokens = chunk.usage.cached_tokens


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict[str, object]:
    """Each prompt counts once however many choices it has; its cached tokens are those of its
    choice that found the most in the prefix cache."""
    num_prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    cached = [0] * len(prompts)
    for c in choices:
        cached[c.prompt] = max(cached[c.prompt], c.cached_tokens)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": completion,
        "total_tokens": num_prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached)},
    }


def choices_of(num_prompts: int, n: int) -> list[Choice]:
    """Choice ``p * n + j`` is the j-th of prompt p (OpenAI's order)."""
    return [Choice(p * n + j, p) for p in range(num_prompts) for j in range(n)]


async def merged(
    backend: Backend,
    prompts: list[list[int]],
    choices: list[Choice],
    params: common_pb2.SamplingParams,
    n: int,
    parent: Context | None = None,
) -> AsyncIterator[tuple[int, common_pb2.TokenChunk]]:
    """Every choice's chunks as they arrive. The first error of any choice ends the whole
    request (the others are cancelled); leaving the iterator early cancels them all. The
    request's span is a child of ``parent`` (a client's traceparent)."""
    started = time.perf_counter()
    rid = uuid.uuid4().hex
    queue: asyncio.Queue[tuple[int, common_pb2.TokenChunk | BaseException | None]] = asyncio.Queue()
    num_prompt = sum(len(p) for p in prompts)
    generated = 0

    async def pump(c: Choice, span: Span) -> None:
        try:
            stream = backend.generate(
                prompts[c.prompt], for_choice(params, c.index % n), f"{rid}-{c.index}", span
            )
            async for chunk in stream:
                await queue.put((c.index, chunk))
            await queue.put((c.index, None))
        except Exception as e:  # any failure of one choice is handed to the reader
            await queue.put((c.index, e))

    model = backend.config.model_name
    with request_span("rest", parent, model, num_prompt, lambda: generated) as span:
        tasks = [asyncio.create_task(pump(c, span)) for c in choices]
        n_streams = len(choices)
        last = [0.0] * n_streams
        running = n_streams
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
                generated += len(item.token_ids)
                metrics.COMPLETION_TOKENS.inc(len(item.token_ids))
                yield i, item
            metrics.E2E.observe(time.perf_counter() - started)
            metrics.PROMPT_TOKENS.inc(num_prompt)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
