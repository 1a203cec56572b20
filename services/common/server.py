"""One shape for every Ferry gRPC server: ``create_server`` / ``serve`` / ``main``.

A server hosts one :class:`Service` plus the standard gRPC health service and reflection.
SIGTERM or SIGINT stops it gracefully: health turns NOT_SERVING, the service drains (leaves the
registry, so nothing new is routed here), in-flight RPCs get ``grace_s`` to finish and are then
cancelled, and the service closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ferry.services.common import tls
from ferry.services.common.channels import server_options
from ferry.services.common.cluster_state import ClusterState, LoadReport, WorkerRecord
from ferry.services.common.config import ServiceConfig
from ferry.services.common.listeners import add_port, run_serving
from ferry.services.common.log import get_logger
from ferry.services.common.metrics_http import start_metrics_server

MAX_MESSAGE_BYTES = 64 << 20
log = get_logger(__name__)


class Service:
    """What a server hosts: its servicers and its life cycle around the server's."""

    role: str = ""
    service_names: tuple[str, ...] = ()  # full names, e.g. "ferry.v1.Scheduler"
    exit_code: int = 0  # set when the service stops itself because it can no longer serve

    def add_to_server(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self, address: str, metrics_port: int) -> None:
        """The server is bound and serving at ``address``: register, start background tasks."""

    async def drain(self) -> None:
        """Stop taking new work (leave the registry); in-flight RPCs still run."""

    async def close(self) -> None:
        """The server has stopped: free everything."""


class RegisteredService(Service):
    """A service in the cluster's registry (Redis) while it serves: registered as ``role`` once
    the server is up, its record (and ``load``, when given) written again every heartbeat, and
    deleted when it drains, so that nothing new finds it. The scheduler and the EPLB controller
    are these; an engine worker registers its engine's facts too and, draining, stays
    registered as draining until its calls end (services/worker/engine_worker.py)."""

    def __init__(self, config: ServiceConfig, load: Callable[[], LoadReport] | None = None) -> None:
        self.worker_id = config.name_for(self.role)
        self.cluster = ClusterState(
            config.redis_url, config.cluster, config.heartbeat_s, config.ttl_s
        )
        self._report_load = load

    def record(self, address: str, metrics_port: int) -> WorkerRecord:
        """What the registry says of this service (an engine worker adds its engine's)."""
        return WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            address=address,
            metrics_port=metrics_port,
            pid=os.getpid(),
            started_at=time.time(),
        )

    async def start(self, address: str, metrics_port: int) -> None:
        """Register; a subclass starts its background tasks after this."""
        await self.cluster.register(self.record(address, metrics_port), self._report_load)

    async def drain(self) -> None:
        await self.cluster.deregister()

    async def close(self) -> None:
        """A subclass frees what it holds first, then calls this."""
        await self.cluster.close()


def create_server(config: ServiceConfig, service: Service) -> tuple[grpc.aio.Server, int]:
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *server_options(),
    ]
    server = grpc.aio.server(options=options)
    service.add_to_server(server)
    names = (*service.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    what = f"the {service.role} gRPC server"
    port = add_port(server, config.host, config.port, what, "--port", tls.server_credentials())
    return server, port


async def serve(config: ServiceConfig, service: Service, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set), then stop gracefully."""
    server, port = create_server(config, service)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    await server.start()
    metrics_port = start_metrics_server(config.metrics_port, config.host)
    address = f"{config.public_host}:{port}"
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start(address, metrics_port)
        for name in ("", *service.service_names):
            await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", role=service.role, address=address, metrics_port=metrics_port)
        await stop.wait()
        log.info("stopping", grace_s=config.grace_s)
        await checker.enter_graceful_shutdown()
        await service.drain()
    finally:
        await server.stop(config.grace_s)
        await service.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("stopped")


def main(config: ServiceConfig, service: Service) -> int:
    return run_serving(serve(config, service), service.role) or service.exit_code


async def abort_with(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    """Log and end the RPC with ``code``."""
    log.info("rejected", code=code.name, message=message)
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker
