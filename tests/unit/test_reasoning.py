"""DeepSeek-R1's thinking split from its answer (gateway/reasoning.py), whole or streamed in any
chunking, with the answer read on for tool calls."""

from __future__ import annotations

import random

import pytest

from ferry.gateway.reasoning import ThinkingReader, reader
from ferry.gateway.tools import CALLS_BEGIN, CALLS_END, CallReader, DeepSeekV3Calls
from tests.unit.test_tools import ds_call, read_all


def splits(text: str) -> list[list[str]]:
    """The whole text, one character at a time, and random chunkings."""
    out = [[text], list(text)]
    for seed in range(10):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", "\nHmm, 2+2.\n", "\n\nIt is 4."),
        ("Hmm, 2+2.</think>It is 4.", "Hmm, 2+2.", "It is 4."),  # <think> was in the prompt
        ("Still thinking <thi", "Still thinking <thi", ""),  # cut at max_tokens: all reasoning
        ("<think>a < b, and </thin", "a < b, and </thin", ""),
        ("<thin", "<thin", ""),
        ("</think>", "", ""),
        ("<think></think>x", "", "x"),
    ],
)
def test_reasoning_then_content_in_any_chunking(text: str, reasoning: str, content: str) -> None:
    for pieces in splits(text):
        out = read_all(ThinkingReader(CallReader()), pieces)
        assert (out.reasoning, out.content) == (reasoning, content), pieces


def test_the_answer_after_thinking_is_read_for_tool_calls() -> None:
    text = "<think>use the tool</think>Sure." + CALLS_BEGIN + ds_call("f", '{"a":1}') + CALLS_END
    for pieces in splits(text):
        r = ThinkingReader(DeepSeekV3Calls())
        out = read_all(r, pieces)
        assert (out.reasoning, out.content) == ("use the tool", "Sure.")
        assert [(c.name, c.arguments) for c in r.calls] == [("f", '{"a":1}')]
        assert len(out.calls) == 1


def test_thinking_that_mentions_a_call_is_not_one() -> None:
    r = ThinkingReader(DeepSeekV3Calls())
    out = read_all(r, [CALLS_BEGIN + ds_call("f", "{}") + "</think>no call"])
    assert r.calls == [] and out.content == "no call"


def test_parser_names() -> None:
    plain = CallReader()
    assert reader("", plain) is plain
    assert isinstance(reader("deepseek_r1", plain), ThinkingReader)
    with pytest.raises(ValueError, match="one of deepseek_r1"):
        reader("qwen3", plain)
