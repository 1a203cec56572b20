"""The OpenAI-compatible REST API (FastAPI): /v1/completions, /v1/chat/completions (SSE when
``stream``), /v1/models, vLLM's /tokenize and /detokenize, /health, /metrics.

Requests are validated here for shape and for what the protobuf fields can hold
(``protocol.py``), and by the engine's SamplingParams for values (the scheduler answers
INVALID_ARGUMENT, which becomes a 400 naming the parameter): streamed ones too, as their status
line waits for the scheduler's first chunk. A client that goes away before its answer cancels
the request on its workers. Text comes from the workers' incremental detokenizer, so streamed
deltas add up to the non-streamed text.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.context import Context
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferry.gateway import metrics, reasoning
from ferry.gateway.backend import Backend
from ferry.gateway.body_limit import BodyLimit
from ferry.gateway.config import GatewayConfig
from ferry.gateway.errors import ERROR_RESPONSES, OpenAIError
from ferry.gateway.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
)
from ferry.gateway.streams import Choice, choices_of, merged, usage
from ferry.gateway.tools import CallReader, Read, ToolUse
from ferry.protos import common_pb2
from ferry.services.common import tracing
from ferry.services.common.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")


# What the routes answer besides JSON, for the OpenAPI schema (their errors: ERROR_RESPONSES).
# A completion: JSON, or with `stream: true` server-sent events of JSON.
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}
_PROMETHEUS: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}
}


def create_app(config: GatewayConfig, backend: Backend | None = None) -> FastAPI:
    owned = backend is None
    backend = backend or Backend(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:  # else its owner closes it
            await backend.close()

    app = FastAPI(title="Ferry", lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.backend = backend

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        try:
            if _needs_key(request.url.path, config):
                _check_key(request, config.api_key)
            response = await call_next(request)
        except OpenAIError as e:
            response = e.response()
        except Exception:  # a bug of ours: still an answer in OpenAI's shape, and counted
            log.exception("gateway_error", path=request.url.path)
            message = "the gateway failed on this request (its log says why)"
            response = OpenAIError(500, message, "internal_error").response()
        # the route's template, not the path a client sent: a bounded set of label values
        route = request.scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        metrics.REQUESTS.labels(endpoint, str(response.status_code)).inc()
        return response

    # added last, so outermost: a body over the limit is refused before anything else runs
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return _invalid_body(e.errors()[0]).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route, a method the route does not take, a body
        that cannot be parsed), in OpenAI's shape."""
        if e.status_code == 404:
            message = f"no route {request.url.path}; the API is under /v1 (see /v1/models)"
            return OpenAIError(404, message, "not_found_error", code="not_found").response()
        if e.status_code == 405:
            message = f"{request.method} is not a method of {request.url.path}"
            return OpenAIError(405, message, code="method_not_allowed").response()
        if e.status_code == 400:  # FastAPI: JSON it could not decode (bad UTF-8, too deep)
            message = "the request body could not be read as JSON (bad UTF-8, or nested too deep)"
            return OpenAIError(400, message, code="json_invalid").response()
        return OpenAIError(e.status_code, str(e.detail), "invalid_request_error").response()

    @app.get("/health", responses={503: {"description": "Not ready: `detail` says why"}})
    async def health() -> JSONResponse:
        ok, why = await backend.ready()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "detail": why}, status_code=200 if ok else 503
        )

    @app.get("/metrics", response_class=Response, responses=_PROMETHEUS)
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [await _model_card(backend)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        backend.check_model(name)
        return await _model_card(backend)

    @app.post("/v1/completions", responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        backend.check_model(body.model)
        given = body.prompts()
        if not given:
            raise OpenAIError(400, "prompt is an empty list", param="prompt")
        if len(given) * body.n > MAX_CHOICES:
            raise OpenAIError(
                400,
                f"{len(given)} prompts x n={body.n} is more than "
                f"{MAX_CHOICES} choices; split the batch",
                param="prompt",
            )
        prompts = await _truncated(backend, body, [backend.encode_prompt(p) for p in given])
        params = _params(body, body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:
            params.prompt_logprobs = body.logprobs
        api = _Completions(backend, body, prompts, tracing.from_headers(request.headers))
        if body.stream:
            return await _sse(request, api.stream(params))
        return JSONResponse(await _unless_gone(request, api.complete(params)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the prompt's token ids (what a completion or chat request would be sent as)
        and the context limit they count against."""
        backend.check_model(body.model)
        if body.messages is not None:
            messages = [m.for_template() for m in body.messages]
            ids = backend.encode_chat(messages, **body.render_options())
        else:
            ids = backend.encode(body.prompt or "", add_bos=body.add_special_tokens)
        strs = [backend.token_text(t) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": await backend.max_model_len(),
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        backend.check_model(body.model)
        return {"prompt": backend.decode(body.tokens)}

    @app.post("/v1/chat/completions", responses=_STREAMED)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        backend.check_model(body.model)
        try:
            tools = body.tool_use(config.tool_call_parser)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="tool_choice") from e
        messages = [m.for_template() for m in body.messages]
        (ids,) = await _truncated(
            backend, body, [backend.encode_chat(messages, **body.render_options())]
        )
        top = body.top_logprobs or 0 if body.logprobs else None
        params = _params(body, body.token_limit(), top)
        if (forced := tools.structured()) is not None:
            params.structured_output.CopyFrom(forced)
        if tools.mode == "auto":  # the call markers are special tokens in DeepSeek's vocabulary
            params.skip_special_tokens = False
        api = _Chat(backend, body, [ids], tools, tracing.from_headers(request.headers))
        if body.stream:
            return await _sse(request, api.stream(params))
        return JSONResponse(await _unless_gone(request, api.complete(params)))

    return app


def _invalid_body(err: Any) -> OpenAIError:
    """A pydantic error about the body as a 400 naming the field (a dotted path)."""
    kind = str(err.get("type"))
    # loc without "body" and without pydantic's names of union members ("str", "list[int]")
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _union_member(x)]
    if kind == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {err.get('msg')}", code=kind)
    if kind == "missing" and not loc:
        return OpenAIError(400, "the request has no body: send a JSON object", code=kind)
    if kind == "unicode":
        return OpenAIError(400, str(err.get("msg")), param=str(err["ctx"]["param"]), code=kind)
    param = ".".join(loc) or None
    msg = str(err.get("msg")).removeprefix("Value error, ")
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param, code=kind)


def _union_member(part: object) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "list", "dict")
    )


async def _truncated(
    backend: Backend, body: _Sampling, prompts: list[list[int]]
) -> list[list[int]]:
    """Each prompt's last ``truncate_prompt_tokens`` tokens (-1: the workers' context limit,
    asked once for the whole batch)."""
    keep = body.truncate_prompt_tokens
    if keep == -1:
        keep = await backend.max_model_len()
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


def _needs_key(path: str, config: GatewayConfig) -> bool:
    """The API (/v1, vLLM's /tokenize and /detokenize) needs the key, /metrics with
    --metrics-auth; /health never (load balancers and `ferry up` probe it)."""
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        return True
    return path == "/metrics" and config.metrics_auth


def _check_key(request: Request, key: str) -> None:
    if not key:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise OpenAIError(
            401,
            "missing or wrong API key (Authorization: Bearer ...)",
            "authentication_error",
            code="invalid_api_key",
        )


async def _model_card(backend: Backend) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``root`` (what is loaded) and ``max_model_len`` (the
    workers' context limit; null while no scheduler answers)."""
    config = backend.config
    return {
        "id": config.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "ferry",
        "root": config.model,
        "max_model_len": await backend.max_model_len(),
    }


# The proto's one-value fields that the body names alike go over as they are; max_tokens and
# logprobs are the route's to give (chat's come from max_completion_tokens and top_logprobs).
_SCALARS = tuple(
    f.name
    for f in common_pb2.SamplingParams.DESCRIPTOR.fields
    if not f.is_repeated
    and f.message_type is None
    and f.name in _Sampling.model_fields
    and f.name not in ("max_tokens", "logprobs")
)


def _params(
    body: _Sampling, max_tokens: int | None, logprobs: int | None
) -> common_pb2.SamplingParams:
    """The request's sampling fields; unset ones stay unset (the engine's defaults apply)."""
    msg = common_pb2.SamplingParams(stop=body.stops(), stop_token_ids=body.stop_token_ids or [])
    for name in _SCALARS:
        if (value := getattr(body, name)) is not None:
            setattr(msg, name, value)
    if (structured := body.structured()) is not None:
        msg.structured_output.CopyFrom(structured)
    if body.logit_bias:  # the values' range is the engine's to check
        msg.logit_bias.update({int(k): v for k, v in body.logit_bias.items()})
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    if logprobs is not None:
        msg.logprobs = logprobs
    return msg


async def _sse(request: Request, events: AsyncGenerator[dict[str, Any], None]) -> Response:
    """Server-sent events. The status line waits for the first event, which comes after the
    scheduler's first chunk: a request that a scheduler or worker refuses (a value out of
    range, a prompt over the context, a grammar that does not compile) is an HTTP error, as a
    non-streamed one is, not a 200 with the error inside."""
    first = await _unless_gone(request, anext(events))

    async def body() -> AsyncIterator[str]:
        try:
            yield f"data: {json.dumps(first)}\n\n"
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except OpenAIError as e:  # a failure after the status line: it goes in the stream
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client disconnects first (the scheduler then aborts the
    request on its workers, freeing its KV blocks): OpenAIError 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise OpenAIError(499, "the client went away before the answer", "cancelled")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body has been read: the next ASGI message on
    this request is its disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _chained(
    first: tuple[int, common_pb2.TokenChunk],
    rest: AsyncIterator[tuple[int, common_pb2.TokenChunk]],
) -> AsyncIterator[tuple[int, common_pb2.TokenChunk]]:
    yield first
    async for item in rest:
        yield item


class _Api:
    object = ""
    chunk_object = ""
    prefix = ""
    num_top = 0  # how many top alternatives the request asked for

    def __init__(
        self,
        backend: Backend,
        body: _Sampling,
        prompts: list[list[int]],
        trace_parent: Context | None = None,  # a client's traceparent header
    ) -> None:
        self.backend, self.body, self.prompts = backend, body, prompts
        self.trace_parent = trace_parent
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = choices_of(len(prompts), body.n)
        self.num_top = self.requested_top()

    def requested_top(self) -> int:
        return 0

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.backend.config.model_name,
            "choices": choices,
        }

    async def complete(self, params: common_pb2.SamplingParams) -> dict[str, Any]:
        async for i, chunk in self._merged(params):
            self.choices[i].add(chunk)
        out = self.envelope(self.object, [self.final_choice(c) for c in self.choices])
        out["usage"] = usage(self.choices, self.prompts)
        return out

    async def stream(
        self, params: common_pb2.SamplingParams
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The events of a streamed answer; nothing before the scheduler's first chunk (see
        _sse), so that a refusal comes before any event."""
        chunks = self._merged(params)
        first = await anext(chunks)
        opts = self.body.stream_options
        final_usage = opts is not None and opts.include_usage
        running_usage = final_usage and opts is not None and opts.continuous_usage_stats

        def counted(event: dict[str, Any]) -> dict[str, Any]:
            if running_usage:
                event["usage"] = usage(self.choices, self.prompts)
            return event

        for event in self.opening():
            yield counted(event)
        async for i, chunk in _chained(first, chunks):
            choice = self.choices[i]
            choice.add(chunk)
            yield counted(self.envelope(self.chunk_object, [self.delta(choice, chunk)]))
        if final_usage:
            event = self.envelope(self.chunk_object, [])
            event["usage"] = usage(self.choices, self.prompts)
            yield event

    def _merged(
        self, params: common_pb2.SamplingParams
    ) -> AsyncIterator[tuple[int, common_pb2.TokenChunk]]:
        return merged(
            self.backend, self.prompts, self.choices, params, self.body.n, self.trace_parent
        )

    def opening(self) -> list[dict[str, Any]]:
        return []

    def final_choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, c: Choice, chunk: common_pb2.TokenChunk) -> dict[str, Any]:
        raise NotImplementedError

    def top(self, lp: common_pb2.TokenLogprobs) -> list[tuple[str, float]]:
        """(token text, logprob) of the top alternatives, most likely first. The engine sends
        the sampled token first, then the top ones without repeating it: n + 1 entries when
        the sampled token is not among the top n, n when it is."""
        entries = list(lp.entries)
        if len(entries) > self.num_top:
            entries = entries[1:]
        entries.sort(key=lambda e: -e.logprob)
        return [(self.backend.token_text(e.token_id), e.logprob) for e in entries]


class _Completions(_Api):
    object = chunk_object = "text_completion"
    prefix = "cmpl"
    body: CompletionRequest

    @functools.cached_property
    def echoed(self) -> list[str]:
        """Each prompt's text, put before its choices' text when body.echo (what is left of
        it after truncate_prompt_tokens)."""
        decode, truncating = self.backend.tokenizer.decode, self.body.truncate_prompt_tokens
        out: list[str] = []
        for given, ids in zip(self.body.prompts(), self.prompts, strict=True):
            if isinstance(given, str) and (
                truncating is None or len(ids) == len(self.backend.encode_prompt(given))
            ):
                out.append(given)  # as it was given: not cut
            else:
                out.append(decode(ids, skip_special_tokens=False))
        return out

    def requested_top(self) -> int:
        return self.body.logprobs or 0

    def logprobs(
        self, token_ids: list[int], lps: list[common_pb2.TokenLogprobs], offset: int
    ) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        tokens = [self.backend.token_text(t) for t in token_ids]
        offsets, at = [], offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.entries[0].logprob for lp in lps],
            "top_logprobs": [dict(self.top(lp)) for lp in lps],
            "text_offset": offsets,
        }

    def echo_logprobs(self, c: Choice) -> dict[str, Any] | None:
        """The prompt's part of an echoed choice's logprobs: its first token has none."""
        out = self.logprobs(self.prompts[c.prompt], c.prompt_logprobs, 0)
        if out is not None:
            out["token_logprobs"].insert(0, None)
            out["top_logprobs"].insert(0, None)
        return out

    def final_choice(self, c: Choice) -> dict[str, Any]:
        lps = self.logprobs(c.token_ids, c.logprobs, 0)
        if not self.body.echo:
            return {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": lps,
            }
        head = self.echoed[c.prompt]
        return {
            "index": c.index,
            "text": head + c.text,
            "finish_reason": c.finish_reason,
            "logprobs": _joined(self.echo_logprobs(c), lps, len(head)),
        }

    def delta(self, c: Choice, chunk: common_pb2.TokenChunk) -> dict[str, Any]:
        offset = len(c.text) - len(chunk.text)
        lps = self.logprobs(list(chunk.token_ids), list(chunk.logprobs), offset)
        text = chunk.text
        if self.body.echo:  # the prompt goes out with the choice's first chunk
            head = self.echoed[c.prompt]
            if c.chunks == 1:
                text, lps = head + text, _joined(self.echo_logprobs(c), lps, len(head))
            elif lps is not None:
                lps["text_offset"] = [at + len(head) for at in lps["text_offset"]]
        return {
            "index": c.index,
            "text": text,
            "finish_reason": chunk.finish_reason or None,
            "logprobs": lps,
        }


def _joined(
    head: dict[str, Any] | None, tail: dict[str, Any] | None, shift: int
) -> dict[str, Any] | None:
    """Completion logprobs ``head`` then ``tail``, the tail's text offsets moved by ``shift``."""
    if head is None or tail is None:
        return None
    tail["text_offset"] = [at + shift for at in tail["text_offset"]]
    return {key: head[key] + tail[key] for key in head}


class _Chat(_Api):
    """Each choice's text goes through its tool-call reader (plain text without tools): the
    content, and the calls the model made (gateway/tools.py)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl"
    body: ChatCompletionRequest

    def __init__(
        self,
        backend: Backend,
        body: ChatCompletionRequest,
        prompts: list[list[int]],
        tools: ToolUse,
        trace_parent: Context | None = None,
    ) -> None:
        super().__init__(backend, body, prompts, trace_parent)
        self.tools = tools
        self.readers = {c.index: self.reader() for c in self.choices}  # while streaming

    def reader(self) -> CallReader:
        """A choice's text: thinking (with a reasoning parser), then content and tool calls."""
        return reasoning.reader(self.backend.config.reasoning_parser, self.tools.reader())

    async def _merged(
        self, params: common_pb2.SamplingParams
    ) -> AsyncIterator[tuple[int, common_pb2.TokenChunk]]:
        try:
            async for item in super()._merged(params):
                yield item
        except OpenAIError as e:  # a forced call's schema is a tool's parameters
            if self.tools.forced and e.param == "response_format":
                e.param = "tools"
            raise

    def requested_top(self) -> int:
        return self.body.top_logprobs or 0

    def logprobs(
        self, token_ids: list[int], lps: list[common_pb2.TokenLogprobs]
    ) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        content = []
        for t, lp in zip(token_ids, lps, strict=False):
            text = self.backend.token_text(t)
            content.append(
                {
                    "token": text,
                    "logprob": lp.entries[0].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": s, "logprob": v, "bytes": list(s.encode())}
                        for s, v in self.top(lp)
                    ],
                }
            )
        return {"content": content}

    def final_choice(self, c: Choice) -> dict[str, Any]:
        reader = self.reader()
        read = reader.feed(c.text)
        read += reader.finish()
        message: dict[str, Any] = {"role": "assistant", "content": read.content}
        if self.backend.config.reasoning_parser:
            message["reasoning_content"] = read.reasoning or None
        if reader.calls:
            message["content"] = read.content or None
            message["tool_calls"] = [call.as_json() for call in reader.calls]
        return {
            "index": c.index,
            "message": message,
            "finish_reason": self.tools.finish_reason(c.finish_reason, reader),
            "logprobs": self.logprobs(c.token_ids, c.logprobs),
        }

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.envelope(
                self.chunk_object,
                [
                    {
                        "index": c.index,
                        "finish_reason": None,
                        "delta": {"role": "assistant", "content": ""},
                    }
                ],
            )
            for c in self.choices
        ]

    def delta(self, c: Choice, chunk: common_pb2.TokenChunk) -> dict[str, Any]:
        reader: CallReader = self.readers[c.index]
        read: Read = reader.feed(chunk.text)
        if chunk.finish_reason:
            read += reader.finish()
        delta: dict[str, Any] = {"content": read.content} if read.content else {}
        if read.reasoning:
            delta["reasoning_content"] = read.reasoning
        if read.calls:
            delta["tool_calls"] = read.calls
        return {
            "index": c.index,
            "delta": delta,
            "finish_reason": self.tools.finish_reason(chunk.finish_reason or None, reader),
            "logprobs": self.logprobs(list(chunk.token_ids), list(chunk.logprobs)),
        }
