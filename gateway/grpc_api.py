"""The public gRPC API (``ferry.v1.Ferry``): the same validation, auth and token stream as the
REST API, in protobuf. Errors keep the scheduler's status codes end to end."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ferry.gateway.backend import Backend
from ferry.gateway.errors import OpenAIError
from ferry.protos import common_pb2, ferry_pb2, ferry_pb2_grpc
from ferry.services.common.channels import ACCEPT_PINGS

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
        await self._check(context, None)
        model = ferry_pb2.ModelInfo(id=self.backend.config.model_name, owned_by="ferry")
        return ferry_pb2.ListModelsReply(models=[model])


async def start_grpc(backend: Backend, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """The Ferry service, health and reflection on ``host:port`` (0: any free port)."""
    server = grpc.aio.server(options=ACCEPT_PINGS)  # clients may use keepalive as ours do
    ferry_pb2_grpc.add_FerryServicer_to_server(FerryServicer(backend), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
