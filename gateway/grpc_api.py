"""The public gRPC API (``ferry.v1.Ferry``): the same validation, auth and token stream as the
REST API, in protobuf. Errors keep the scheduler's status codes end to end."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ferry.gateway import metrics
from ferry.gateway.backend import Backend
from ferry.gateway.errors import OpenAIError, http_status
from ferry.protos import common_pb2, ferry_pb2, ferry_pb2_grpc
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
            try:
                ids = self.backend.encode_prompt(request.prompt or list(request.prompt_token_ids))
                async for chunk in self.backend.generate(
                    ids, request.sampling_params, request.request_id
                ):
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
    ferry_pb2_grpc.add_FerryServicer_to_server(FerryServicer(backend), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = add_port(server, host, port, "the gateway's gRPC API", "--grpc-port")
    await server.start()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
