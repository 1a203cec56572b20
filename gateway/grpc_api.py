"""The public gRPC API (``ferry.v1.Ferry``): the same validation, auth and token stream as the
REST API, in protobuf. Errors keep the scheduler's status codes end to end."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ferry.gateway import metrics
from ferry.gateway.backend import Backend, request_span
from ferry.gateway.errors import OpenAIError, http_status
from ferry.protos import common_pb2, ferry_pb2, ferry_pb2_grpc
from ferry.services.common import tls, tracing
from ferry.services.common.channels import ACCEPT_PINGS
from ferry.services.common.listeners import NO_PORT_SHARING, add_port

SERVICE_NAME = "ferry.v1.Ferry"


class FerryServicer(ferry_pb2_grpc.FerryServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def _check(self, context: grpc.aio.ServicerContext, model: str | None) -> None:
        key = self.backend.config.api_key
        if key:
            given = dict(context.invocation_metadata() or ()).get("authorization", "")
            if not hmac.compare_digest(str(given).encode(), f"Bearer {key}".encode()):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong API key (metadata authorization: Bearer ...)",
                )
        if model is not None:
            try:
                self.backend.check_model(model)
            except OpenAIError as e:
                await context.abort(e.grpc_code, e.message)

    async def Generate(
        self, request: ferry_pb2.TextGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        async with _counted("Generate", context):
            await self._check(context, request.model or self.backend.config.model_name)
            if request.prompt and request.prompt_token_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "give prompt or prompt_token_ids, not both"
                )
            generated = 0
            try:
                ids = self.backend.encode_prompt(request.prompt or list(request.prompt_token_ids))
                model = self.backend.config.model_name
                parent = tracing.incoming(context)
                with request_span("grpc", parent, model, len(ids), lambda: generated) as span:
                    async for chunk in self.backend.generate(
                        ids, request.sampling_params, request.request_id, span
                    ):
                        generated += len(chunk.token_ids)
                        yield chunk
            except OpenAIError as e:
                await context.abort(e.grpc_code, e.message)

    async def ListModels(
        self, request: ferry_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> ferry_pb2.ListModelsReply:
        async with _counted("ListModels", context):
            await self._check(context, None)
            model = ferry_pb2.ModelInfo(id=self.backend.config.model_name, owned_by="ferry")
            return ferry_pb2.ListModelsReply(models=[model])


@dataclass(frozen=True)
class _Malformed:
    """A request whose bytes do not parse as its message. Its method answers INVALID_ARGUMENT
    with ``why``; a deserializer that raised would have grpc answer UNKNOWN."""

    why: str


def _reader(kind: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    def read(data: bytes) -> Message | _Malformed:
        try:
            return kind.FromString(data)
        except DecodeError as e:
            name = kind.DESCRIPTOR.full_name
            return _Malformed(f"the request is not a {name} in protobuf's wire format ({e})")

    return read


def _handler(name: str, behavior: Any, streaming: bool) -> Any:
    """The servicer's method ``behavior``, which a _Malformed request does not reach."""

    async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
        async with _counted(name, context):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)

    async def unary(request: Message | _Malformed, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            return await refuse(request, context)
        return await behavior(request, context)

    async def stream(
        request: Message | _Malformed, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await refuse(request, context)
            return
        async for reply in behavior(request, context):
            yield reply

    return stream if streaming else unary


def _add_servicer(servicer: FerryServicer, server: grpc.aio.Server) -> None:
    """What ferry_pb2_grpc.add_FerryServicer_to_server does, each method's handler made from
    the service's descriptor, with a request deserializer that does not raise (_reader)."""
    handlers = {}
    for method in ferry_pb2.DESCRIPTOR.services_by_name["Ferry"].methods:
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _handler(method.name, getattr(servicer, method.name), method.server_streaming),
            request_deserializer=_reader(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@contextlib.asynccontextmanager
async def _counted(method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Count the call in ``ferry_gateway_requests_total`` as the REST API counts its requests:
    its method as the endpoint, the HTTP status its gRPC status stands for."""
    status = 200
    try:
        yield
    except asyncio.CancelledError:  # the client went away
        status = 499
        raise
    except Exception:  # context.abort's, or a failure of ours (INTERNAL)
        status = http_status(context.code() or grpc.StatusCode.INTERNAL)
        raise
    finally:
        metrics.REQUESTS.labels(f"/{SERVICE_NAME}/{method}", str(status)).inc()


async def start_grpc(backend: Backend, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """The Ferry service, health and reflection on ``host:port`` (0: any free port)."""
    # clients may use keepalive as ours do; the port is this server's alone
    server = grpc.aio.server(options=[*ACCEPT_PINGS, *NO_PORT_SHARING])
    _add_servicer(FerryServicer(backend), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    # public: TLS when configured, but no client certificate (clients show the API key)
    creds = tls.server_credentials(client_auth=False)
    bound = add_port(server, host, port, "the gateway's gRPC API", "--grpc-port", creds)
    await server.start()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
