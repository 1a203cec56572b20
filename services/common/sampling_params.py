"""SamplingParams: how one request turns logits into tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (vLLM's structured outputs; see ``structured.py``)."""

    kind: StructuredKind
    spec: str = ""  # json_schema: the schema as JSON text; regex; grammar: EBNF
    choices: tuple[str, ...] = ()  # choice: the output is exactly one of these

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind {self.kind!r}: one of {STRUCTURED_KINDS}")
        if self.kind == "choice" and not (self.choices and all(self.choices)):
            raise ValueError("structured output (choice): give at least one non-empty choice")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"structured output ({self.kind}) is empty")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; n: the sampled token's plus the top n
    # None: none; n: each prompt token's (all but the first) plus the top n. Such a request
    # computes its whole prompt: a cached prefix has no logits to give.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs, added to the logits before penalties and temperature; a dict is
    # accepted. Logprobs are still those of the raw logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16  # None: until the model's length limit
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # the text of what stopped the request (a stop string; EOS or a stop token id) ends the
    # output text; by default it is left out, as in vLLM
    include_stop_str_in_output: bool = False
    # scheduling, not sampling (it rides here to reach every worker a request runs on): a
    # worker admits waiting requests in (priority, arrival) order and preempts the last in it
    # first; lower runs first, as in vLLM's priority policy. All equal: first come first served
    priority: int = 0
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Lists are accepted and stored as tuples so the params stay hashable and immutable.
        object.__setattr__(
            self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop)
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        bad_bias = next(((t, b) for t, b in self.logit_bias if t < 0 or not -100 <= b <= 100), None)
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in 0..20"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in 0..20",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (-(2**31) <= self.priority < 2**31, "priority must be a 32-bit integer"),
            (
                self.structured_output is None or self.min_tokens == 0,
                "min_tokens cannot be combined with a structured output (the grammar may "
                "allow only EOS before min_tokens)",
            ),
            (
                bad_bias is None,
                f"logit_bias {bad_bias}: token ids are >= 0 and biases in [-100, 100]",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def uses_top_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


GREEDY = SamplingParams(temperature=0.0)
