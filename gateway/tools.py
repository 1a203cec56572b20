"""OpenAI tool calling on /v1/chat/completions, as vLLM does it for DeepSeek models.

``tool_choice`` (default ``"auto"`` when ``tools`` are given, else ``"none"``):

- ``"none"``: the chat template shows the tools to the model; its text is the content.
- ``"auto"``: the model decides. Calls are read out of its text in DeepSeek-V3's format
  (:class:`DeepSeekV3Calls`, the gateway's ``--tool-call-parser deepseek_v3``); the text before
  them is the content::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
      ```json
      ARGUMENTS
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

  or in DeepSeek-V3.1's (and later's) (:class:`DeepSeekV31Calls`, ``deepseek_v31``)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>...

- ``"required"`` and a named function (``{"type": "function", "function": {"name": ...}}``):
  the output is forced through structured outputs by a JSON Schema: a list of ``{"name",
  "parameters"}`` objects, each one of the tools' (one at most without ``parallel_tool_calls``)
  (:class:`RequiredCalls`), or the named function's arguments (:class:`NamedCall`).

Each choice reads its text through one :class:`CallReader`, chunk by chunk while streaming or
all at once, so that a stream's deltas add up to the whole response.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from ferry.protos import common_pb2

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL = re.compile(
    r"\s*"
    + re.escape(CALL_BEGIN)
    + r"(?P<type>[^\n]*?)"
    + re.escape(SEP)
    + r"(?P<name>[^\n]*?)\n```json\n(?P<arguments>.*?)\n```"
    + re.escape(CALL_END),
    re.DOTALL,
)
_CALL_V31 = re.compile(
    r"\s*"
    + re.escape(CALL_BEGIN)
    + r"(?P<name>[^\n]*?)"
    + re.escape(SEP)
    + r"(?P<arguments>.*?)"
    + re.escape(CALL_END),
    re.DOTALL,
)

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:  # streamed deltas say which call they belong to
            out["index"] = index
        return out


@dataclass
class Read:
    """What a piece of a choice's text turned out to be: content, tool-call deltas in OpenAI's
    streamed shape (``{"index", "id", "type", "function": {"name", "arguments"}}``, later
    deltas of one call with ``arguments`` only), and a reasoning model's thinking
    (gateway/reasoning.py)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""

    def __iadd__(self, other: Read) -> Read:
        self.content += other.content
        self.calls += other.calls
        self.reasoning += other.reasoning
        return self


class CallReader:
    """Reads one choice's text; ``calls`` holds the calls made once :meth:`finish` is done.
    The base class reads plain text (``tool_choice: "none"``)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Read:
        return Read(content=text)

    def finish(self) -> Read:
        return Read()

    def _made(self, call: ToolCall) -> dict[str, Any]:
        self.calls.append(call)
        return call.as_json(index=len(self.calls) - 1)


class DeepSeekV3Calls(CallReader):
    """``"auto"``: content until ``<｜tool▁calls▁begin｜>``, then calls, each sent whole once
    its ``<｜tool▁call▁end｜>`` arrives. A tail that is not a well-formed call (the model
    stopped mid-call, or wrote something else) comes out as content: no text is lost."""

    call = _CALL  # one call, as the model writes it

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text not yet sent: a possible start of the marker, or a call's
        self.in_calls = False

    def feed(self, text: str) -> Read:
        self.pending += text
        out = Read()
        if not self.in_calls:
            at = self.pending.find(CALLS_BEGIN)
            if at < 0:  # hold back what could be the marker's first characters
                cut = len(self.pending) - partial_suffix(self.pending, CALLS_BEGIN)
                out.content, self.pending = self.pending[:cut], self.pending[cut:]
                return out
            out.content = self.pending[:at]
            self.pending = self.pending[at + len(CALLS_BEGIN) :]
            self.in_calls = True
        while (m := self.call.match(self.pending)) is not None:
            out.calls.append(self._made(ToolCall(m["name"].strip(), m["arguments"].strip())))
            self.pending = self.pending[m.end() :]
        return out

    def finish(self) -> Read:
        rest = self.pending
        if self.in_calls:
            rest = rest.strip()
            if rest.startswith(CALLS_END):
                rest = rest[len(CALLS_END) :]
            elif not self.calls:  # no call was made: the marker was only text
                rest = CALLS_BEGIN + self.pending
        self.pending = ""
        return Read(content=rest)


class DeepSeekV31Calls(DeepSeekV3Calls):
    """DeepSeek-V3.1's calls: the name, then the arguments as they are (no type, no json
    block)."""

    call = _CALL_V31


TOOL_CALL_PARSERS: dict[str, type[DeepSeekV3Calls]] = {
    "deepseek_v3": DeepSeekV3Calls,
    "deepseek_v31": DeepSeekV31Calls,
}


class NamedCall(CallReader):
    """A named function: the whole text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call = ToolCall(name, "")
        self.arguments = ""

    def feed(self, text: str) -> Read:
        if not text:
            return Read()
        first = not self.arguments
        self.arguments += text
        if first:
            return Read(calls=[ToolCall(self.call.name, text, self.call.id).as_json(index=0)])
        return Read(calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> Read:
        self.calls[:] = [ToolCall(self.call.name, self.arguments, self.call.id)]
        return Read()


class RequiredCalls(CallReader):
    """``"required"``: a JSON list of ``{"name", "parameters"}``; sent when it is complete
    (text that does not parse, from a request cut at max_tokens, is sent as content)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, text: str) -> Read:
        self.text += text
        return Read()

    def finish(self) -> Read:
        try:
            made = json.loads(self.text)
            calls = [
                ToolCall(c["name"], json.dumps(c["parameters"], separators=(",", ":")))
                for c in made
            ]
        except (ValueError, TypeError, KeyError):
            return Read(content=self.text)
        return Read(calls=[self._made(c) for c in calls])


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools (OpenAI's ``{"type": "function", "function": {...}}`` dicts, as
    chat templates take them) and how it wants them used."""

    mode: Mode = "none"
    tools: tuple[dict[str, Any], ...] = ()
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "deepseek_v3"  # how "auto" reads calls: one of TOOL_CALL_PARSERS

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def reader(self) -> CallReader:
        if self.mode == "auto":
            return TOOL_CALL_PARSERS[self.parser]()
        if self.mode == "required":
            return RequiredCalls()
        if self.mode == "named":
            assert self.name is not None
            return NamedCall(self.name)
        return CallReader()

    def structured(self) -> common_pb2.StructuredOutput | None:
        """The JSON Schema that forces the output (required, named); None otherwise."""
        params = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
            for t in self.tools
        }
        if self.mode == "named":
            assert self.name is not None
            schema: dict[str, Any] = params[self.name]
        elif self.mode == "required":
            one_of = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": p},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, p in params.items()
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema))

    def finish_reason(self, reason: str | None, reader: CallReader) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required) and stopped
        by itself; a named function's call ends with "stop"."""
        if reason == "stop" and reader.calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
