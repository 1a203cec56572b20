"""Tool calls read out of a choice's text (gateway/tools.py): DeepSeek-V3's format for "auto",
the forced JSON for "required" and a named function; streamed in any chunking, the reads add up
to the whole text's."""

from __future__ import annotations

import json
import random

import pytest

from ferry.gateway.tools import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    CallReader,
    DeepSeekV3Calls,
    DeepSeekV31Calls,
    NamedCall,
    Read,
    RequiredCalls,
    ToolUse,
)


def ds_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


TWO_CALLS = (
    "Let me look that up."
    + CALLS_BEGIN
    + ds_call("get_weather", '{"city": "Tokyo"}')
    + "\n"
    + ds_call("get_time", '{"zone": "JST", "fmt": "a```b"}')
    + CALLS_END
)


def read_all(reader: CallReader, pieces: list[str]) -> Read:
    out = Read()
    for piece in pieces:
        out += reader.feed(piece)
    out += reader.finish()
    return out


def chunkings(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_deepseek_v3_calls_and_the_content_before_them() -> None:
    reader = DeepSeekV3Calls()
    out = read_all(reader, [TWO_CALLS])
    assert out.content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
        ("get_weather", {"city": "Tokyo"}),
        ("get_time", {"zone": "JST", "fmt": "a```b"}),
    ]
    assert [d["index"] for d in out.calls] == [0, 1]
    assert out.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}
    assert out.calls[0]["id"] != out.calls[1]["id"]


@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_any_chunking_the_reads_add_up_to_the_whole(seed: int) -> None:
    whole = DeepSeekV3Calls()
    want = read_all(whole, [TWO_CALLS])
    reader = DeepSeekV3Calls()
    got = read_all(reader, chunkings(TWO_CALLS, seed))
    assert got.content == want.content
    assert [(c.name, c.arguments) for c in reader.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]


def test_character_by_character_nothing_of_the_marker_leaks_into_the_content() -> None:
    reader = DeepSeekV3Calls()
    contents = [reader.feed(ch).content for ch in TWO_CALLS]
    contents.append(reader.finish().content)
    assert "".join(contents) == "Let me look that up."
    assert len(reader.calls) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no tools here, just <｜tool▁calls",  # a marker's start, then the end of the text
        CALLS_BEGIN + "not a call",  # the marker, then text that is not a call
        CALLS_BEGIN + ds_call("f", "{}")[:-5],  # cut in the middle of a call (max_tokens)
        "a < b <｜ and <｜tool",
    ],
)
def test_text_that_is_not_a_call_comes_out_as_content(text: str) -> None:
    for pieces in ([text], list(text)):
        reader = DeepSeekV3Calls()
        out = read_all(reader, pieces)
        assert out.content == text and reader.calls == [] and out.calls == []


def test_after_the_calls_stray_text_is_content() -> None:
    reader = DeepSeekV3Calls()
    out = read_all(reader, [CALLS_BEGIN + ds_call("f", "{}") + " trailing"])
    assert [c.name for c in reader.calls] == ["f"] and out.content == "trailing"


def test_required_reads_the_forced_list() -> None:
    reader = RequiredCalls()
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"f","parameters":{}}]'
    out = read_all(reader, chunkings(text, 1))
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("f", {}),
    ]
    assert [d["index"] for d in out.calls] == [0, 1]
    cut = RequiredCalls()  # cut short by max_tokens: the text is not lost
    assert read_all(cut, [text[:30]]).content == text[:30] and cut.calls == []


def test_named_streams_the_arguments_as_they_come() -> None:
    reader = NamedCall("get_weather")
    out = read_all(reader, ['{"ci', "", 'ty":', '"Rome"}'])
    assert out.calls[0] == {
        "index": 0,
        "id": reader.calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"ci'},
    }
    assert all(set(d) == {"index", "function"} for d in out.calls[1:])
    assert "".join(d["function"]["arguments"] for d in out.calls) == '{"city":"Rome"}'
    assert reader.calls[0].arguments == '{"city":"Rome"}'


TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
)


def test_forced_modes_give_a_schema_the_others_none() -> None:
    named = ToolUse("named", TOOLS, name="get_weather").structured()
    assert named is not None
    assert json.loads(named.json_schema) == TOOLS[0]["function"]["parameters"]
    required = ToolUse("required", TOOLS, parallel=False).structured()
    assert required is not None
    schema = json.loads(required.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert ToolUse("auto", TOOLS).structured() is None
    assert ToolUse("none", TOOLS).structured() is None


def test_finish_reason_is_tool_calls_when_the_model_chose_to_call() -> None:
    called = DeepSeekV3Calls()
    read_all(called, [CALLS_BEGIN + ds_call("f", "{}")])
    assert ToolUse("auto", TOOLS).finish_reason("stop", called) == "tool_calls"
    assert ToolUse("auto", TOOLS).finish_reason("length", called) == "length"
    assert ToolUse("auto", TOOLS).finish_reason("stop", DeepSeekV3Calls()) == "stop"
    named = NamedCall("now")
    read_all(named, ["{}"])
    assert ToolUse("named", TOOLS, name="now").finish_reason("stop", named) == "stop"


def test_deepseek_v31_calls_name_then_bare_arguments() -> None:
    """DeepSeek-V3.1's format: no type, no json block; in any chunking."""
    text = (
        "Checking."
        + CALLS_BEGIN
        + f'{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}'
        + f"{CALL_BEGIN}now{SEP}{{}}{CALL_END}"
        + CALLS_END
    )
    for seed in range(10):
        reader = DeepSeekV31Calls()
        out = read_all(reader, chunkings(text, seed))
        assert out.content == "Checking."
        assert [(c.name, c.arguments) for c in reader.calls] == [
            ("get_weather", '{"city": "Oslo"}'),
            ("now", "{}"),
        ]
    v3 = DeepSeekV3Calls()  # V3's reader wants the json block: V3.1's calls stay text
    assert read_all(v3, [text]).content == text and v3.calls == []
    assert isinstance(ToolUse("auto", TOOLS, parser="deepseek_v31").reader(), DeepSeekV31Calls)
