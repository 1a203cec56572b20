"""The OpenAI request bodies the gateway accepts (pydantic). Unknown fields are refused (400), so
that a misspelled parameter is not silently ignored. Here: the shape, what the protobuf fields
can hold (32- and 64-bit integers, finite numbers, valid Unicode), each a 400 naming the field;
the values' meaning (temperature >= 0, ...) is the engine's SamplingParams' to check, and comes
back from the scheduler as INVALID_ARGUMENT."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ferry.gateway.tools import ToolUse
from ferry.protos import common_pb2

MAX_N = 16
MAX_CHOICES = 256  # prompts x n of one /v1/completions request


Int32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]  # what a protobuf int32 holds
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON can spell a lone UTF-16 surrogate (\\ud800), which no UTF-8 text holds."""
        if (where := _bad_unicode(data)) is not None:
            raise PydanticCustomError(
                "unicode",
                "{param}: a lone surrogate (\\ud800-\\udfff) is not text",
                {"param": where},
            )
        return data


def _bad_unicode(value: Any, path: str = "") -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode text, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        if (bad := _bad_unicode(key, path)) is not None:
            return bad
        if (bad := _bad_unicode(item, f"{path}.{key}" if path else str(key))) is not None:
            return bad
    return None


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk's usage so far


class JsonSchema(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's: free text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema exactly when type is 'json_schema'")
        return self


class StructuredOutputs(_Body):
    """vLLM's: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON Schema
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k, v in self.model_dump(by_alias=True).items() if v not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, json_object, regex, choice, grammar "
                f"(got {', '.join(given) or 'none'})"
            )
        return self


class _Sampling(_Body):
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    # OpenAI's: {"token id": bias in [-100, 100]}, JSON keys being strings
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the output
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with what stopped it
    # vLLM's: lower is admitted first and preempted last on each worker (a 32-bit integer)
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    # vLLM's: only the prompt's last k tokens are sent (-1: as many as the context holds)
    truncate_prompt_tokens: Int32 | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _one_format(self) -> _Sampling:
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def structured(self) -> common_pb2.StructuredOutput | None:
        """What the output must match, as the workers take it; None: free text."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.json_schema is not None:
            return common_pb2.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_))
        if fmt is not None and fmt.type == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        if so is None:
            return None
        if so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            return common_pb2.StructuredOutput(json_schema=schema)
        if so.choice is not None:
            return common_pb2.StructuredOutput(choice=common_pb2.Choices(values=so.choice))
        if so.regex is not None:
            return common_pb2.StructuredOutput(regex=so.regex)
        if so.grammar is not None:
            return common_pb2.StructuredOutput(grammar=so.grammar)
        return common_pb2.StructuredOutput(json_object=True)

    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's fields that change nothing here: taken and ignored, as vLLM does
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _options_of_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is for a streamed request (stream: true)")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise ValueError(
                "give the number of tokens to keep (at least 1), or -1 for as many "
                "as the model's context holds"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((k for k in value or {} if not k.strip().isdigit()), None)
        if bad is not None:
            raise ValueError(f"key {bad!r} is not a token id (the keys are token ids, as strings)")
        big = next((k for k in value or {} if int(k) >= 2**31), None)
        if big is not None:
            raise ValueError(f"key {big}: token ids are below 2^31")
        return value


class CompletionRequest(_Sampling):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) first

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, value: Any) -> Any:
        """One message for a prompt of no accepted shape, not one per shape it is not."""
        shapes = (
            str,
            lambda v: _all(v, int),
            lambda v: _all(v, str),
            lambda v: _all(v, list) and all(_all(x, int) for x in v),
        )
        if not any(isinstance(value, s) if isinstance(s, type) else s(value) for s in shapes):
            raise ValueError(
                "give a string, a list of token ids, or a list of either (a batch of prompts)"
            )
        ids = value if _all(value, int) else [t for p in value if _all(p, int) for t in p]
        if (bad := next((t for t in ids if not 0 <= t < 2**31), None)) is not None:
            raise ValueError(f"token id {bad} is outside 0..2^31-1")
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Body):
    """A call an earlier assistant turn made, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # a string, or OpenAI's content parts ([{"type": "text", "text": ...}, ...], as LangChain and
    # agent frameworks send); the model reads text only
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _a_tool_turn_answers_a_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(
                    f"a content part of type {kind!r}: this model reads text only "
                    "(give a string or parts of type 'text')"
                )
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: its content one string (text parts joined by
        newlines, as vLLM joins them for text-only models)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class Function(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: any object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class ChatPrompt(_Body):
    """How chat messages become the prompt: the fields vLLM's chat requests and /tokenize
    share, as :meth:`ChatTemplate.render`'s options."""

    add_generation_prompt: bool = True
    # the final message is left open (no end-of-turn after it) for the model to go on with it
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    tools: list[Tool] | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("two tools have the same name")
        return tools

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_field_of_ours(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted({"messages", "tools", "add_generation_prompt"} & set(value or ()))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the request's own fields")
        return value

    @model_validator(mode="after")
    def _one_ending(self) -> ChatPrompt:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message needs add_generation_prompt: false (the "
                "final message goes on, no new one starts)"
            )
        return self

    def render_options(self) -> dict[str, Any]:
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "tools": tool_dicts(self.tools),
            "extra": self.chat_template_kwargs,
        }


class ChatCompletionRequest(_Sampling, ChatPrompt):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def tool_use(self, parser: str = "deepseek_v3") -> ToolUse:
        """How the tools are to be used (``parser``: how "auto" reads calls); ValueError (a 400
        naming tool_choice) when the request contradicts itself."""
        tools = tool_dicts(self.tools) or []
        names = [t["function"]["name"] for t in tools]
        choice = self.tool_choice or ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {_choice_text(choice)} needs tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {choice.function.name!r}, which is not one "
                    f"of the tools ({', '.join(names)})"
                )
            use = ToolUse("named", tuple(tools), choice.function.name, self.parallel_tool_calls)
        else:
            use = ToolUse(choice, tuple(tools), None, self.parallel_tool_calls, parser)
        if use.forced and (self.response_format or self.structured_outputs):
            raise ValueError(
                f"tool_choice {_choice_text(choice)} sets the output's form itself: "
                "give no response_format or structured_outputs with it"
            )
        return use

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class TokenizeRequest(ChatPrompt):
    """vLLM's /tokenize: a completion prompt, or chat messages as /v1/chat/completions would
    render them (ChatPrompt's fields: for messages only)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a prompt's BOS (messages: the template decides)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int]


def _choice_text(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name}}}"


def _all(value: Any, kind: type) -> bool:
    """A list whose items are all ``kind`` (bool is not an int here)."""
    return isinstance(value, list) and all(
        isinstance(x, kind) and not isinstance(x, bool) for x in value
    )
