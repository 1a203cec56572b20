"""What the gateway's APIs share: the model's tokenizer and chat template, and the token stream
from the scheduler (``Scheduler.Generate``)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from ferry.gateway import metrics
from ferry.gateway.chat_template import ChatTemplate
from ferry.gateway.config import GatewayConfig
from ferry.gateway.errors import OpenAIError, from_grpc
from ferry.gateway.schedulers import Replica, SchedulerPool
from ferry.protos import common_pb2, scheduler_pb2
from ferry.services.common import tracing
from ferry.services.common.log import get_logger
from ferry.services.common.streamed import Streamed
from ferry.services.common.tokenizer import NoTokenizer, Tokenizer, load_tokenizer

log = get_logger(__name__)


def for_choice(params: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Choice ``index`` of n: a seeded request gives each choice its own seed (seed + index)."""
    if index == 0 or not params.HasField("seed"):
        return params
    out = common_pb2.SamplingParams()
    out.CopyFrom(params)
    out.seed = params.seed + index
    return out


@contextlib.contextmanager
def request_span(
    api: str,
    parent: Context | None,
    model: str,
    prompt_tokens: int,
    output_tokens: Callable[[], int],
) -> Iterator[Span]:
    """The span of one API request (``api``: rest or grpc), the parent of its choices'
    ``stream`` spans. ``status`` is the HTTP status the client gets, or stands for (gRPC), and
    499 when the client went away first."""
    with tracing.span("request", parent, api=api, model=model, prompt_tokens=prompt_tokens) as span:
        status = 499
        try:
            yield span
            status = 200
        except OpenAIError as e:
            status = e.status
            raise
        except Exception:
            status = 500
            raise
        finally:
            span.set_attributes({"status": status, "output_tokens": output_tokens()})


class Backend:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        # vLLM's --skip-tokenizer-init: prompts as token ids only, outputs with empty text
        self.token_ids_only = isinstance(self.tokenizer, NoTokenizer)
        self.chat_template = ChatTemplate.for_model(config.model)
        self.schedulers = SchedulerPool(config.schedulers, config.scheduler_wait_s)

    async def close(self) -> None:
        await self.schedulers.close()

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.config.model_name}`",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids; an empty prompt is a 400 (over gRPC too, where an empty
        string cannot be told from none)."""
        if not prompt:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """``text``'s token ids; a 400 (``prompt``) for a model without a tokenizer."""
        if self.token_ids_only:
            raise OpenAIError(400, NoTokenizer.ENCODE_ERROR, param="prompt")
        return self.tokenizer.encode(text, add_bos)

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """The messages through the chat template (``options``: ChatTemplate.render's), as
        token ids; a template that fails, or a model without a tokenizer, is a 400."""
        if self.token_ids_only:
            raise OpenAIError(
                400,
                "the model has no tokenizer.json, so it cannot read chat messages: send a "
                "completion whose prompt is token ids",
                param="messages",
            )
        try:
            text = self.chat_template.render(messages, **options)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from e
        bos = self.chat_template.special.get("bos_token", "")
        return self.tokenizer.encode(text, add_bos=not (bos and text.startswith(bos)))

    def decode(self, token_ids: list[int]) -> str:
        if self.token_ids_only:
            raise OpenAIError(
                400, "the model has no tokenizer.json, so it cannot decode tokens", param="tokens"
            )
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(
                400,
                f"token id {bad} is outside the tokenizer's vocabulary (0..{vocab - 1})",
                param="tokens",
            )
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def max_model_len(self) -> int | None:
        """The smallest length limit among the workers a request starts on (prefill and
        aggregated), as the first scheduler that answers sees them; None when none answers or
        no such worker is registered."""
        for replica in self.schedulers.replicas:
            try:
                reply = await replica.stub.ClusterStatus(
                    scheduler_pb2.ClusterStatusRequest(), timeout=2
                )
            except grpc.aio.AioRpcError:
                continue
            limits = [
                w.info.max_model_len
                for w in reply.workers
                if w.info.role in ("prefill", "aggregated") and w.info.max_model_len
            ]
            return min(limits, default=None)
        return None

    def token_text(self, token_id: int) -> str:
        """The token as logprobs name it: its text, or vLLM's ``token_id:N`` for a model without
        a tokenizer (all texts would be "")."""
        if self.token_ids_only:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def generate(
        self,
        prompt_ids: list[int],
        params: common_pb2.SamplingParams,
        request_id: str = "",
        parent: Span = trace.INVALID_SPAN,
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        """The scheduler's token stream; a gRPC error becomes an OpenAIError. Closing the
        iterator (a client that went away) cancels the request upstream. Its span (``stream``,
        a child of ``parent``) is the parent of the schedulers' spans.

        When the connection to the request's scheduler drops (the scheduler died or is
        restarting; the request died with it), a request that had streamed nothing is sent once
        more, and one that had streamed tokens goes on, up to ``migration_limit`` times, as the
        prompt + the tokens sent with ``resumed`` saying so: to another replica when one is
        connected. An UNAVAILABLE that the scheduler itself answers is not retried: its
        connection is still up (and the scheduler has done its own retries)."""
        rid = request_id or uuid.uuid4().hex
        first = scheduler_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt_ids, sampling_params=params
        )
        req, sent, retried, dropped = first, Streamed(), False, ""
        with tracing.span("stream", parent, request_id=rid) as span:
            while True:
                replica = await self.schedulers.pick(avoid=dropped)
                call = replica.stub.Generate(
                    req, timeout=self.config.request_timeout_s, metadata=tracing.outgoing(span)
                )
                streamed = False
                try:
                    with replica.streaming():
                        async for chunk in call:
                            if not streamed and not sent.token_ids:
                                span.add_event("first_chunk", {"scheduler": replica.address})
                            streamed = True
                            sent.forward(chunk, rid)
                            yield chunk
                            if chunk.finish_reason:  # a connection lost after it loses nothing
                                return
                    return
                except grpc.aio.AioRpcError as e:
                    if not await replica.dropped(e):
                        raise from_grpc(e.code(), e.details() or "") from e
                    if streamed and sent.can_move(self.config.migration_limit):
                        metrics.MIGRATIONS.inc()
                        req = sent.move(first, rid, "g")
                    elif not streamed and not retried:
                        retried = True
                    else:
                        why = (
                            f"the scheduler at {replica.address} went away after "
                            f"{len(sent.token_ids)} tokens of this request ({e.details()}); "
                            "retry it"
                        )
                        raise OpenAIError(
                            503, why, "service_unavailable", code="scheduler_unavailable"
                        ) from e
                    log.info(
                        "scheduler_connection_lost",
                        request_id=rid,
                        scheduler=replica.address,
                        generated=len(sent.token_ids),
                        migration=sent.moves,
                    )
                    span.add_event("scheduler_lost", {"scheduler": replica.address})
                    dropped = replica.address
                finally:
                    call.cancel()  # a no-op once the stream has ended
                    span.set_attributes(
                        {"output_tokens": len(sent.token_ids), "migrations": sent.moves}
                    )

    async def ready(self) -> tuple[bool, str]:
        """Ready when a scheduler answers and sees an aggregated worker, or a prefill and a
        decode worker; the reason is the first replica's when none is."""
        answers = await asyncio.gather(*(_ready(r) for r in self.schedulers.replicas))
        return next((a for a in answers if a[0]), answers[0])


async def _ready(replica: Replica) -> tuple[bool, str]:
    try:
        reply = await replica.stub.ClusterStatus(scheduler_pb2.ClusterStatusRequest(), timeout=2)
    except grpc.aio.AioRpcError as e:
        return False, f"scheduler at {replica.address}: {e.code().name}"
    roles = {w.info.role for w in reply.workers}
    if "aggregated" in roles:
        return True, "ok"
    missing = [r for r in ("prefill", "decode") if r not in roles]
    if missing:
        return False, f"no {' and no '.join(missing)} worker registered"
    return True, "ok"
