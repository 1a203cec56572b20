"""Request: one sequence's state inside the engine; RequestOutput: what callers see of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.common.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from ferry.services.engine.structured import GrammarMatcher

FinishReason = Literal["stop", "length", "abort"]


class Status(enum.Enum):
    WAITING = "waiting"  # new, or preempted and waiting to recompute
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output tokens it may get
    detokenizer: IncrementalDetokenizer
    num_resumed: int = 0  # the prompt's last tokens that this request generated elsewhere
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    admitted_ns: int = 0  # time.time_ns() of its first admission (0: it came with its KV)
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its row of the cache's state rings, while it runs
    restore_snapshot: int | None = None  # a prefix hit's state, copied in before its next step
    # a hand-off with state: blocks reserved for its state slot's bytes, sent with its prompt's
    state_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_preemptions: int = 0
    arrival: int = 0  # its place in its engine's arrival order (the planner numbers them)
    hand_off: bool = False  # prefill role: stop after the first token and keep the KV for export
    text: str = ""  # emitted text (stop strings excluded)
    pending_text: str = ""  # decoded but held back: may be the start of a stop string
    logprobs: list[dict[int, float]] | None = None
    # params.prompt_logprobs: one entry per prompt token after the first, filled by the prefill
    prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    matcher: GrammarMatcher | None = None  # params.structured_output's state (structured.py)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_generated(self) -> int:
        """Output tokens so far, counting those generated before a move (see ``Resumed``)."""
        return self.num_resumed + len(self.output_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[n - self.num_resumed :] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """Cumulative state of a request after a step; ``delta_*`` is what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[dict[int, float]] | None
    num_cached_tokens: int
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float]] | None = None  # complete from the first output on
    # Set on a hand-off request's last output: the hold (see KVCacheManager.hold) that keeps its
    # prompt's blocks (then, with state, the blocks its state is packed in), and those blocks.
    # The KV exporter turns the hold into a lease.
    kv_hold: str | None = None
    kv_block_ids: list[int] = field(default_factory=list)
    admitted_ns: int = 0  # Request.admitted_ns: a trace splits its queue wait from its prefill

    @property
    def finished(self) -> bool:
        """No further output follows: the request ended or was handed off to a decode worker."""
        return self.finish_reason is not None or self.kv_hold is not None


@dataclass(frozen=True)
class ImportedKv:
    """A request that continues on this engine from KV computed elsewhere (decode role): its
    prompt's blocks are held under ``hold_key`` and ``first_token_id`` was already sampled."""

    hold_key: str
    first_token_id: int
    first_logprobs: dict[int, float] | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Resumed:
    """A request that moved here from a worker that failed mid-stream (request migration): the
    last ``num_output_tokens`` of its prompt are what it had generated, and the client already
    has the first ``num_emitted_chars`` characters of their text."""

    num_output_tokens: int
    num_emitted_chars: int
