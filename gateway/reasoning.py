"""Reasoning models' thinking, kept apart from the answer (vLLM's ``--reasoning-parser``).

``deepseek_r1``: DeepSeek-R1 thinks first and closes its thinking with ``</think>`` (its chat
template opens ``<think>`` in the prompt, so the output may or may not start with it). The text
before ``</think>`` is the reply's ``reasoning_content`` (the field DeepSeek's own API uses); the
text after it is the content, read on for tool calls as without a reasoning parser. An output
that never closes its thinking (cut at max_tokens) is all reasoning, as in vLLM.
"""

from __future__ import annotations

from ferry.gateway.tools import CallReader, Read, partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("deepseek_r1",)


class ThinkingReader(CallReader):
    """Reasoning until ``</think>``, then the text goes to ``then`` (content and tool calls).
    While streaming, a possible start of either tag is held back until the next text shows
    what it is."""

    def __init__(self, then: CallReader) -> None:
        super().__init__()
        self.then = then
        self.calls = then.calls  # the same list: the calls are the answer's
        self.pending = ""
        self.opened = False  # past a leading <think>, or sure there is none
        self.closed = False  # past </think>: the answer

    def feed(self, text: str) -> Read:
        if self.closed:
            return self.then.feed(text)
        self.pending += text
        if not self.opened:
            if THINK_START.startswith(self.pending):
                return Read()  # all of it could still be <think>
            self.opened = True
            self.pending = self.pending.removeprefix(THINK_START)
        at = self.pending.find(THINK_END)
        if at < 0:
            cut = len(self.pending) - partial_suffix(self.pending, THINK_END)
            out = Read(reasoning=self.pending[:cut])
            self.pending = self.pending[cut:]
            return out
        out = Read(reasoning=self.pending[:at])
        rest, self.pending, self.closed = self.pending[at + len(THINK_END) :], "", True
        out += self.then.feed(rest)
        return out

    def finish(self) -> Read:
        out = Read()
        if not self.closed:  # never closed: all of it was thinking
            out.reasoning, self.pending = self.pending.removeprefix(THINK_START), ""
        out += self.then.finish()
        return out


def reader(parser: str, then: CallReader) -> CallReader:
    """``then`` behind the named reasoning parser ("": none)."""
    if not parser:
        return then
    if parser == "deepseek_r1":
        return ThinkingReader(then)
    raise ValueError(f"reasoning parser {parser!r}: one of {', '.join(REASONING_PARSERS)}")
