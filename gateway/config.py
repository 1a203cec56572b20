"""GatewayConfig: what the gateway serves and how it meets its clients and schedulers. No
metrics or servers here: the CLI builds it from flags in every process."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.gateway.reasoning import REASONING_PARSERS
from ferry.gateway.tools import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class GatewayConfig:
    model: str = "tiny"  # preset or checkpoint directory: the tokenizer and chat template
    served_model_name: str = ""  # the name clients send as `model` (default: model)
    # the scheduler replicas' gRPC addresses; 127.0.0.1:50052 is where `ferry up` puts the first
    schedulers: tuple[str, ...] = ("127.0.0.1:50052",)
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # the public gRPC API (ferry.v1.Ferry); -1: off, 0: any free port
    api_key: str = ""  # "" : no authentication
    metrics_auth: bool = False  # GET /metrics needs the key too (/health never does)
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 600.0
    # A request that finds no scheduler reachable (restarting) waits this long for one, then
    # gets 503; /health says "not ready" at once.
    scheduler_wait_s: float = 15.0
    # times a stream whose scheduler went away after it streamed tokens goes on through another
    # (0: it fails with the scheduler's UNAVAILABLE)
    migration_limit: int = 0
    # vLLM's --reasoning-parser: a reasoning model's thinking goes to reasoning_content
    # (gateway/reasoning.py); "": none
    reasoning_parser: str = ""
    # vLLM's --tool-call-parser: the format tool_choice "auto" reads calls in (gateway/tools.py)
    tool_call_parser: str = "deepseek_v3"

    def __post_init__(self) -> None:
        if not self.schedulers:
            raise ValueError("give at least one scheduler address (--scheduler)")
        if self.reasoning_parser not in ("", *REASONING_PARSERS):
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r}: one of "
                f"{', '.join(REASONING_PARSERS)}, or '' for none"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r}: one of "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
