"""What a request has streamed to its client, and the request that goes on from there. This is
the seam of request migration, shared by two loops one level apart: the scheduler moves a
request whose worker went away (``--migration-limit`` of the scheduler), the gateway one whose
scheduler went away (``--migration-limit`` of the gateway). Both forward each chunk through
``forward``, ask ``can_move`` when their call fails, and send ``move``'s request on."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.protos import common_pb2, scheduler_pb2


@dataclass
class Streamed:
    """The tokens and text sent so far, across moves; ``before`` / ``chars_before``: what the
    client had before this request (a request that is itself a continuation)."""

    token_ids: list[int] = field(default_factory=list)
    num_chars: int = 0
    moves: int = 0
    before: int = 0
    chars_before: int = 0

    @classmethod
    def after(cls, request: scheduler_pb2.GenerateRequest) -> Streamed:
        r = request.resumed
        return cls(before=r.num_output_tokens, chars_before=r.num_emitted_chars)

    def add(self, chunk: common_pb2.TokenChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.num_chars += len(chunk.text)

    def forward(self, chunk: common_pb2.TokenChunk, request_id: str) -> None:
        """Count ``chunk`` as sent, under the client's request id (not a moved part's)."""
        self.add(chunk)
        chunk.request_id = request_id

    def can_move(self, limit: int) -> bool:
        """The request has streamed tokens, and fewer than ``limit`` moves so far."""
        return bool(self.token_ids) and self.moves < limit

    def move(
        self, request: scheduler_pb2.GenerateRequest, request_id: str, tag: str
    ) -> scheduler_pb2.GenerateRequest:
        """One more move: the rest of ``request`` under ``{request_id}.{tag}{moves}`` (the part
        before it may linger on its worker under the old id)."""
        self.moves += 1
        part = self.rest(request)
        part.request_id = f"{request_id}.{tag}{self.moves}"
        return part

    def resumed(self) -> common_pb2.Resumed:
        return common_pb2.Resumed(
            num_output_tokens=self.before + len(self.token_ids),
            num_emitted_chars=self.chars_before + self.num_chars,
        )

    def rest(self, request: scheduler_pb2.GenerateRequest) -> scheduler_pb2.GenerateRequest:
        """The rest of ``request`` after what was sent: those tokens appended to the prompt,
        max_tokens / min_tokens lowered by their number, and ``resumed`` saying so."""
        k = len(self.token_ids)
        params = common_pb2.SamplingParams()
        params.CopyFrom(request.sampling_params)
        if params.HasField("max_tokens"):
            params.max_tokens -= k  # >= 1: the request would have ended otherwise
        params.min_tokens = max(0, params.min_tokens - k)
        params.ClearField("prompt_logprobs")  # the client has them from the first chunk
        return scheduler_pb2.GenerateRequest(
            request_id=request.request_id,
            sampling_params=params,
            prompt_token_ids=[*request.prompt_token_ids, *self.token_ids],
            resumed=self.resumed(),
        )

    def count_usage(self, usage: common_pb2.Usage, request: scheduler_pb2.GenerateRequest) -> None:
        """A moved request's last chunk reports its last part; the client wants the whole."""
        n = len(request.prompt_token_ids) - self.before
        usage.prompt_tokens, usage.completion_tokens = n, self.before + len(self.token_ids)
        usage.cached_tokens = min(usage.cached_tokens, n)
