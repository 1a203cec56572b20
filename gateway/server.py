"""``ferry serve gateway``: the REST API on uvicorn (graceful on SIGTERM / SIGINT)."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.backend import GatewayConfig
from services.common.log import configure_logging, get_logger

log = get_logger(__name__)


def main(config: GatewayConfig, log_level: str = "info") -> int:
    configure_logging("gateway", f"gateway-{config.port}", log_level)
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=5))  # fmt: skip
    log.info("serving", role="gateway", address=f"{config.host}:{config.port}",
             model=config.model_name, scheduler=config.scheduler)  # fmt: skip
    server.run()
    return 0
