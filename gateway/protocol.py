"""The OpenAI request bodies the gateway accepts (pydantic). Unknown fields are refused (400), so
that a misspelled parameter is not silently ignored. Range checks live in the engine's
SamplingParams and come back from the scheduler as INVALID_ARGUMENT; here only the shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_CHOICES = 256  # prompts x n of one /v1/completions request


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # OpenAI's: {"token id": bias in [-100, 100]}, JSON keys being strings
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the output
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with what stopped it
    # vLLM's: lower is admitted first and preempted last on each worker (a 32-bit integer)
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((k for k in value or {} if not k.strip().isdigit()), None)
        if bad is not None:
            raise ValueError(f"key {bad!r} is not a token id (the keys are token ids, as strings)")
        return value


class CompletionRequest(_Sampling):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) first

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, value: Any) -> Any:
        """One message for a prompt of no accepted shape, not one per shape it is not."""
        shapes = (str, lambda v: _all(v, int), lambda v: _all(v, str),
                  lambda v: _all(v, list) and all(_all(x, int) for x in v))  # fmt: skip
        if not any(isinstance(value, s) if isinstance(s, type) else s(value) for s in shapes):
            raise ValueError("give a string, a list of token ids, or a list of either "
                             "(a batch of prompts)")  # fmt: skip
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # a string, or OpenAI's content parts ([{"type": "text", "text": ...}, ...], as LangChain and
    # agent frameworks send); the model reads text only
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"a content part of type {kind!r}: this model reads text only "
                                 "(give a string or parts of type 'text')")  # fmt: skip
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: its content one string (text parts joined by
        newlines, as vLLM joins them for text-only models)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a completion prompt, or chat messages as /v1/chat/completions would
    render them."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a prompt's BOS (messages: the template decides)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int]


def _all(value: Any, kind: type) -> bool:
    """A list whose items are all ``kind`` (bool is not an int here)."""
    return isinstance(value, list) and all(
        isinstance(x, kind) and not isinstance(x, bool) for x in value
    )
