"""The SDK's exceptions: one class per gRPC status a caller can act on, each carrying the
server's status and message."""

from __future__ import annotations

import grpc


class FerryError(Exception):
    """A call to Ferry failed. ``code`` is the gRPC status, ``message`` the server's words."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequestError(FerryError):
    """The request was refused as it is (INVALID_ARGUMENT, FAILED_PRECONDITION)."""


class AuthenticationError(FerryError):
    """Missing or wrong API key (UNAUTHENTICATED)."""


class NotFoundError(FerryError):
    """No such model (NOT_FOUND)."""


class RateLimitError(FerryError):
    """The cluster is full; try again later (RESOURCE_EXHAUSTED)."""


class UnavailableError(FerryError):
    """No server or worker could take the request (UNAVAILABLE)."""


class TimeoutError(FerryError):
    """The call ran past its timeout (DEADLINE_EXCEEDED)."""


_BY_CODE: dict[grpc.StatusCode, type[FerryError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
}


def from_rpc_error(e: grpc.RpcError) -> FerryError:
    code: grpc.StatusCode = e.code()
    details: str = e.details() or ""
    return _BY_CODE.get(code, FerryError)(code, details)
