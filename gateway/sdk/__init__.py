"""Ferry's Python client SDK (over the gateway's public gRPC API, ``ferry.v1.Ferry``)."""

from ferry.gateway.sdk.client import AsyncFerryClient, FerryClient
from ferry.gateway.sdk.errors import (
    AuthenticationError,
    FerryError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    TimeoutError,
    UnavailableError,
)
from ferry.gateway.sdk.types import Chunk, Completion, Model, Usage

__all__ = [
    "AsyncFerryClient",
    "AuthenticationError",
    "Chunk",
    "Completion",
    "FerryClient",
    "FerryError",
    "InvalidRequestError",
    "Model",
    "NotFoundError",
    "RateLimitError",
    "TimeoutError",
    "UnavailableError",
    "Usage",
]
