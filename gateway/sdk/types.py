"""What the SDK returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Chunk:
    """One message of a stream: the text and token ids generated since the previous one.
    ``finish_reason`` ("stop", "length", "abort") and ``usage`` come on the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # on the first chunk


@dataclass(frozen=True)
class Completion:
    """A whole generation: every chunk put together."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # sampling prompt_logprobs=n: one per prompt token after the first (that token's first)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Model:
    id: str
    owned_by: str
