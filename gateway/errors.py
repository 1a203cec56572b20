"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and how the
scheduler's gRPC statuses become HTTP ones."""

from __future__ import annotations

import re
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ferry.protos import common_pb2

# The engine's validation messages start with the sampling field at fault ("temperature must
# be >= 0, ..."): the gateway reports it as the error's ``param``.
PARAMS = tuple(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
RETRY_AFTER_S = 1


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str  # what to change, for a person
    type: str
    param: str | None  # the request's field at fault (a dotted path), when one is
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error answer, OpenAI's."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


# The error answers of every route in the OpenAPI schema. FastAPI's own 422 is never sent: a
# body it refuses is a 400 in this shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "A client mistake: `message` says what to change"},
    "5XX": {
        "model": ErrorBody,
        "description": "No scheduler or worker could serve it (503, 504), or a gateway failure",
    },
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status a gRPC status stands for (OK: 200)."""
    return 200 if code == grpc.StatusCode.OK else _HTTP.get(code, (500, ""))[0]


_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class OpenAIError(Exception):
    """An error for a client of either API: ``status`` for HTTP, ``grpc_code`` for gRPC."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        grpc_code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.grpc_code = grpc_code or _GRPC.get(status, grpc.StatusCode.INTERNAL)

    def body(self) -> dict[str, object]:
        """An ``ErrorBody``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# the scheduler names the worker that refused a request: "prefill worker prefill-0: ..."
_WORKER = re.compile(r"^\w+ worker \S+: ")


def from_grpc(code: grpc.StatusCode, details: str) -> OpenAIError:
    status, kind = _HTTP.get(code, (500, "internal_error"))
    what = _WORKER.sub("", details)
    param = next((p for p in PARAMS if what.startswith(p + " ")), None)
    if param is None and what.startswith(("prompt", "prompt_token_ids")):
        param = "prompt"
    if param is None and what.startswith("structured output"):
        param = "response_format"  # (or structured_outputs: the message names the kind)
    return OpenAIError(status, details, kind, param, code.name.lower(), grpc_code=code)
