"""``ferry serve gateway``: the REST API (uvicorn) and the public gRPC API on one event loop.
SIGTERM / SIGINT stop both gracefully: uvicorn finishes its requests, then gRPC gets its grace."""

from __future__ import annotations

import signal

import uvicorn

from ferry.gateway.app import create_app
from ferry.gateway.backend import Backend
from ferry.gateway.config import GatewayConfig
from ferry.gateway.grpc_api import start_grpc
from ferry.services.common import tls
from ferry.services.common.listeners import listen_tcp, run_serving
from ferry.services.common.log import configure_logging, get_logger

log = get_logger(__name__)
GRACE_S = 5.0


async def serve(config: GatewayConfig, log_level: str = "info") -> None:
    """PortInUse, before anything else, when the HTTP or the gRPC port is taken."""
    sock = listen_tcp(config.host, config.port, "the gateway", "--port")
    port = sock.getsockname()[1]
    backend = Backend(config)
    app = create_app(config, backend)
    certs = tls.files()  # HTTPS with the certificate the gateway shows its peers, when given
    http = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            log_config=None,  # its records reach our JSON handler (configure_logging)
            access_log=False,
            timeout_graceful_shutdown=int(GRACE_S),
            ssl_certfile=certs.cert or None,
            ssl_keyfile=certs.key or None,
        )
    )
    grpc_server = None
    try:
        if config.grpc_port >= 0:
            grpc_server, grpc_port = await start_grpc(backend, config.host, config.grpc_port)
            log.info("serving", role="gateway", grpc=f"{config.host}:{grpc_port}")
    except BaseException:
        sock.close()
        await backend.close()
        raise
    log.info(
        "serving",
        role="gateway",
        http=f"{tls.http_scheme()}://{config.host}:{port}",
        model=config.model_name,
        schedulers=",".join(config.schedulers),
    )
    # uvicorn raises the SIGTERM / SIGINT it stopped on again once it has stopped: under the
    # default handlers that ends the process at once, before the gRPC API's grace below and
    # before `ferry serve` flushes its traces; under these it goes on to them
    previous = {sig: signal.signal(sig, _taken) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        await http.serve([sock])  # returns on SIGTERM / SIGINT (uvicorn's handlers)
    finally:
        for sig, handler in previous.items():  # a second signal now stops it outright
            signal.signal(sig, handler)
        if grpc_server is not None:
            await grpc_server.stop(GRACE_S)
        await backend.close()
    log.info("stopped")


def _taken(sig: int, frame: object) -> None:
    """The signal uvicorn raises again after its own handler has stopped it: already acted on."""


def main(config: GatewayConfig, log_level: str = "info") -> int:
    configure_logging("gateway", f"gateway-{config.port}", log_level)
    return run_serving(serve(config, log_level), "gateway")
