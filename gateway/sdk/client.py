"""FerryClient and AsyncFerryClient: Ferry's public gRPC API (``ferry.v1.Ferry``) as a Python
library.

    with FerryClient("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=16, temperature=0.7):
            print(chunk.text, end="", flush=True)
        print(client.complete("Hello", max_tokens=16).usage)

A request that fails with UNAVAILABLE before any token arrived is retried (``max_retries``
times, exponential backoff); any other failure raises a :class:`~gateway.sdk.errors.FerryError`
subclass carrying the server's status and message. Leaving a stream early cancels the request on
the server, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from ferry.gateway.sdk.errors import from_rpc_error
from ferry.gateway.sdk.types import Chunk, Completion, Model, Usage
from ferry.protos import common_pb2, ferry_pb2, ferry_pb2_grpc

# the keywords generate() and complete() take: every SamplingParams field but stop, an
# argument of its own
_SAMPLING = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name) - {"stop"}


def _request(
    prompt: str | Sequence[int], model: str, stop: str | Sequence[str] | None, kw: dict[str, Any]
) -> ferry_pb2.TextGenerateRequest:
    unknown = set(kw) - _SAMPLING
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    params = common_pb2.SamplingParams(**{k: v for k, v in kw.items() if v is not None})
    params.stop.extend([stop] if isinstance(stop, str) else list(stop or []))
    req = ferry_pb2.TextGenerateRequest(model=model, sampling_params=params)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    return req


def _chunk(msg: common_pb2.TokenChunk) -> Chunk:
    usage = None
    if msg.finish_reason:
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    return Chunk(
        text=msg.text,
        token_ids=list(msg.token_ids),
        logprobs=[_entries(lp) for lp in msg.logprobs],
        finish_reason=msg.finish_reason or None,
        usage=usage,
        prompt_logprobs=[_entries(lp) for lp in msg.prompt_logprobs],
    )


def _entries(lp: common_pb2.TokenLogprobs) -> dict[int, float]:
    return {e.token_id: e.logprob for e in lp.entries}


def _completion(chunks: Sequence[Chunk]) -> Completion:
    last = chunks[-1]
    assert last.usage is not None and last.finish_reason is not None
    return Completion(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=[lp for c in chunks for lp in c.logprobs],
        prompt_logprobs=[lp for c in chunks for lp in c.prompt_logprobs],
    )


class _Base:
    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        model: str = "",
        timeout: float = 300.0,
        max_retries: int = 2,
        retry_backoff: float = 0.2,
        tls_ca: str | None = None,
    ) -> None:
        """``model``: the default model (default: the one the server serves); ``timeout``: per
        call, in seconds; ``max_retries``: extra tries of a call that got UNAVAILABLE before
        any token; ``tls_ca``: TLS, trusting this PEM CA ("": the system's CAs; None: plain
        text)."""
        self.address = address
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._credentials = None
        if tls_ca is not None:
            ca = Path(tls_ca).read_bytes() if tls_ca else None
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca)

    def _retryable(self, e: grpc.RpcError, attempt: int, streamed: bool) -> bool:
        code = e.code()
        return not streamed and code == grpc.StatusCode.UNAVAILABLE and attempt < self.max_retries


class FerryClient(_Base):
    """A blocking client; use it as a context manager or call :meth:`close`."""

    def __init__(self, address: str = "127.0.0.1:50051", **kw: Any) -> None:
        super().__init__(address, **kw)
        self._channel = (
            grpc.secure_channel(address, self._credentials)
            if self._credentials
            else grpc.insecure_channel(address)
        )
        self._stub = ferry_pb2_grpc.FerryStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = True,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Stream chunks as they are generated. ``sampling``: max_tokens, temperature, top_p,
        top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, seed, logprobs,
        prompt_logprobs (n: each prompt token's logprob after the first, plus the top n, on the
        first chunk), min_tokens, ignore_eos, stop_token_ids, logit_bias ({token id: bias in
        [-100, 100]}), skip_special_tokens (True), include_stop_str_in_output (False),
        priority (0; lower is admitted first and preempted last on each worker),
        structured_output (one of {"json_schema": "<schema JSON>"}, {"json_object": True},
        {"regex": ...}, {"choice": {"values": [...]}}, {"grammar": "<EBNF>"}).
        With ``stream=False`` the one chunk holds everything."""
        req = _request(prompt, model if model is not None else self.model, stop, sampling)
        chunks = self._stream(req)
        if stream:
            return chunks
        c = _completion(list(chunks))
        return iter(
            [Chunk(c.text, c.token_ids, c.logprobs, c.finish_reason, c.usage, c.prompt_logprobs)]
        )

    def complete(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        stop: str | Sequence[str] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Generate to the end; same parameters as :meth:`generate`."""
        return _completion(list(self.generate(prompt, model=model, stop=stop, **sampling)))

    def models(self) -> list[Model]:
        try:
            reply = self._stub.ListModels(
                ferry_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return [Model(m.id, m.owned_by) for m in reply.models]

    def _stream(self, req: ferry_pb2.TextGenerateRequest) -> Iterator[Chunk]:
        attempt = 0
        while True:
            call = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
            streamed = False
            try:
                for msg in call:
                    streamed = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as e:
                if not self._retryable(e, attempt, streamed):
                    raise from_rpc_error(e) from None
            finally:
                call.cancel()  # the caller left early: cancel upstream (a no-op when done)
            time.sleep(self.retry_backoff * 2**attempt)
            attempt += 1

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> FerryClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncFerryClient(_Base):
    """The asyncio client: the same API with ``async for`` / ``await``."""

    def __init__(self, address: str = "127.0.0.1:50051", **kw: Any) -> None:
        super().__init__(address, **kw)
        self._channel = (
            grpc.aio.secure_channel(address, self._credentials)
            if self._credentials
            else grpc.aio.insecure_channel(address)
        )
        self._stub = ferry_pb2_grpc.FerryStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        stop: str | Sequence[str] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Chunk]:
        """Stream chunks as they are generated (see :meth:`FerryClient.generate`)."""
        req = _request(prompt, model if model is not None else self.model, stop, sampling)
        attempt = 0
        while True:
            call = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
            streamed = False
            try:
                async for msg in call:
                    streamed = True
                    yield _chunk(msg)
                return
            except grpc.aio.AioRpcError as e:
                if not self._retryable(e, attempt, streamed):
                    raise from_rpc_error(e) from None
            finally:
                call.cancel()
            await asyncio.sleep(self.retry_backoff * 2**attempt)
            attempt += 1

    async def complete(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        stop: str | Sequence[str] | None = None,
        **sampling: Any,
    ) -> Completion:
        chunks = [c async for c in self.generate(prompt, model=model, stop=stop, **sampling)]
        return _completion(chunks)

    async def models(self) -> list[Model]:
        try:
            reply = await self._stub.ListModels(
                ferry_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return [Model(m.id, m.owned_by) for m in reply.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncFerryClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
