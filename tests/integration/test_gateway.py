"""The OpenAI REST API end to end: the official `openai` client against a real `ferry up`
cluster (redis-server, prefill, decode, scheduler and gateway processes)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ferry.gateway.chat_template import ChatTemplate
from ferry.gateway.sdk import AuthenticationError, FerryClient
from ferry.infra.ports import free_port
from ferry.services.common.tokenizer import load_tokenizer
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.cluster import Cluster, ferry_up
from tests.helpers import Checkpoint
from tests.redis_server import RedisServer
from tests.waits import wait_until

WORKER_ARGS = "--block-size 16 --verify-checksum"
_GRPC_PORTS: dict[int, int] = {}  # a test gateway's HTTP port -> its gRPC port
CHECKPOINT = Checkpoint(seed=5, lm_head_scale=20.0)


@pytest.fixture(scope="module")
def cluster(redis: RedisServer, checkpoint: Path) -> Iterator[Cluster]:
    with ferry_up(
        redis.url,
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        "256",
        "--schedulers",
        "2",
        "--migration-limit",
        "1",
        "--worker-args",
        WORKER_ARGS,
        cluster="gw",
    ) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway + "/v1", api_key="unused", max_retries=0)


def model_of(checkpoint: Path) -> str:
    return str(checkpoint)


def test_completion_text_and_usage_match_the_tokens(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    prompt = "The ferry crosses the"
    out = client.completions.create(
        model=model_of(checkpoint),
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    tok = load_tokenizer(checkpoint)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and out.usage is not None
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert choice.text and isinstance(choice.text, str)


def test_streamed_deltas_concatenate_to_the_whole_text(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    kw = {
        "model": model_of(checkpoint),
        "prompt": "Stream me some text",
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )  # type: ignore[call-overload]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(stream=True, stream_options=opts, **kw))  # type: ignore[call-overload]
    counts = [c.usage.completion_tokens for c in chunks if c.usage]
    assert len(counts) == len(chunks) and counts == sorted(counts) and counts[-1] == 20
    assert counts[0] >= 1 and counts[-2] == 20  # (the decode worker may send tokens together)
    assert all(c.usage and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)  # type: ignore[union-attr]


def test_chat_completion_streaming_and_not(client: openai.OpenAI, checkpoint: Path) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    kw = {
        "model": model_of(checkpoint),
        "messages": messages,
        "max_completion_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    out = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    msg = out.choices[0].message
    assert msg.role == "assistant" and out.choices[0].finish_reason == "length"
    prompt = ChatTemplate.for_model(str(checkpoint)).render(messages)
    assert out.usage is not None and out.usage.completion_tokens == 10
    assert out.usage.prompt_tokens == len(load_tokenizer(checkpoint).encode(prompt))
    deltas = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == msg.content


def test_chat_content_parts_read_as_their_text_joined(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """OpenAI's content parts (what LangChain and agent SDKs send) give the prompt of their
    texts joined by newlines; a part the model cannot read is a 400 that names it."""
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]
    kw = {"model": model_of(checkpoint), "max_completion_tokens": 6, "temperature": 0}
    given = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)  # type: ignore[call-overload]
    joined = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say\nsomething."}], **kw
    )  # type: ignore[call-overload]
    assert given.choices[0].message.content == joined.choices[0].message.content
    assert given.usage and joined.usage  # the second's prompt is cached: compare the counts
    assert given.usage.prompt_tokens == joined.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(messages=[{"role": "user", "content": [image]}], **kw)  # type: ignore[call-overload]
    assert "messages.0.content" in str(refused.value)
    assert "a content part of type 'image_url': this model reads text only" in str(refused.value)


def test_logit_bias_steers_every_token_prefill_and_decode_alike(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """The prefill worker draws the first token and the decode worker the rest: both add the
    bias. The logprobs stay those of the unbiased model."""
    tok = load_tokenizer(checkpoint)
    kw = {
        "model": model_of(checkpoint),
        "prompt": "The ferry",
        "max_tokens": 5,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True},
    }
    plain = client.completions.create(temperature=0, **kw)  # type: ignore[call-overload]
    first = tok.encode(plain.choices[0].text)[-1]  # a token greedy decoding would not repeat
    forced = client.completions.create(temperature=0.8, seed=3, logit_bias={str(first): 100}, **kw)  # type: ignore[call-overload]
    lp = forced.choices[0].logprobs
    assert lp is not None and lp.tokens == [tok.decode([first], skip_special_tokens=False)] * 5
    assert lp.token_logprobs is not None and all(x < 0 for x in lp.token_logprobs)


def test_skip_special_tokens_and_include_stop_str_in_output(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """vLLM's two text options, on the prefill and the decode worker alike: BOS forced by
    logit_bias is left out of the text unless skip_special_tokens is false; a stop token's
    text and a stop string end the text only with include_stop_str_in_output."""
    tok = load_tokenizer(checkpoint)
    bos = tok.decode([256], skip_special_tokens=False)
    kw = {
        "model": model_of(checkpoint),
        "prompt": "The ferry",
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": {"256": 100},
    }

    def text(**extra: object) -> tuple[str, str | None]:
        choice = client.completions.create(**kw, extra_body={"ignore_eos": True, **extra}).choices[
            0
        ]  # type: ignore[call-overload]
        return choice.text, choice.finish_reason

    assert text() == ("", "length") and text(skip_special_tokens=False) == (bos * 3, "length")
    # min_tokens keeps BOS out of the first two tokens: the decode worker draws the stop
    stopped = {"skip_special_tokens": False, "stop_token_ids": [256], "min_tokens": 2}
    first_two, reason = text(**stopped)
    assert reason == "stop" and first_two and bos not in first_two
    assert text(**stopped, include_stop_str_in_output=True) == (first_two + bos, "stop")
    del kw["logit_bias"]
    kw["max_tokens"] = 12
    plain, _ = text()
    stop = next(
        plain[i : i + 2] for i in range(3, len(plain) - 2) if plain[i : i + 2].isprintable()
    )
    end = plain.index(stop)
    assert text(stop=stop) == (plain[:end], "stop")
    assert text(stop=stop, include_stop_str_in_output=True) == (plain[: end + 2], "stop")


def test_response_format_and_structured_outputs_constrain_the_text(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """OpenAI's response_format and vLLM's structured_outputs reach the prefill worker (the
    first token) and the decode worker (the rest, its grammar state replayed from the first)."""
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["ok", "tag"],
        "properties": {
            "ok": {"type": "boolean"},
            "tag": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        },
    }
    model = model_of(checkpoint)
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "JSON please"}],
            seed=seed,
            temperature=1.0,
            max_completion_tokens=100,
            response_format=fmt,  # type: ignore[arg-type]
        )
        choice = reply.choices[0]
        value = json.loads(choice.message.content or "")
        assert choice.finish_reason == "stop" and set(value) == {"ok", "tag"}, value
        assert isinstance(value["ok"], bool) and re.fullmatch("[a-z]{1,5}", value["tag"])
    kw = {
        "model": model,
        "prompt": "Pick:",
        "max_tokens": 20,
        "temperature": 1.0,
        "n": 4,
        "seed": 1,
    }
    picks = client.completions.create(
        **kw, extra_body={"structured_outputs": {"choice": ["left", "right"]}}
    )  # type: ignore[call-overload]
    assert {c.text for c in picks.choices} <= {"left", "right"}
    streamed = client.completions.create(
        **kw,
        stream=True,  # type: ignore[call-overload]
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    texts = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(re.fullmatch("[0-9]{3}", t) for t in texts), texts
    for extra, param, message in [
        ({"structured_outputs": {"regex": "(ab"}}, "response_format", "(regex) does not compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "exactly one of"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            None,
            "not both",
        ),
        ({"response_format": {"type": "json_schema"}}, None, "give json_schema exactly when"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="x", max_tokens=5, extra_body=extra)
        body = e.value.body
        assert isinstance(body, dict) and message in body["message"], body
        assert param is None or body["param"] == param


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "metric"],
            "properties": {
                "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                "metric": {"type": "boolean"},
            },
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"enum": ["utc", "cet"]}},
        },
    },
}


def _valid_call(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return (
            set(args) == {"city", "metric"}
            and isinstance(args["metric"], bool)
            and re.fullmatch("[a-z]{1,8}", args["city"]) is not None
        )
    return name == "now" and args in ({"zone": "utc"}, {"zone": "cet"})


def test_a_named_or_required_tool_choice_forces_a_call_to_the_tools(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """tool_choice naming a function makes the whole output its arguments; "required" makes it
    a list of calls to the tools: both forced by the JSON Schema, on prefill and decode alike."""
    model = model_of(checkpoint)
    ask = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER, CLOCK],
        "temperature": 1.0,
        "max_completion_tokens": 200,
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        reply = client.chat.completions.create(**ask, seed=seed, tool_choice=named)  # type: ignore[call-overload]
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "stop" and choice.message.content is None
        assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        assert _valid_call("get_weather", calls[0].function.arguments), calls  # type: ignore[union-attr]
        streamed = client.chat.completions.create(**ask, seed=seed, tool_choice=named, stream=True)  # type: ignore[call-overload]
        deltas = [d for chunk in streamed for c in chunk.choices for d in c.delta.tool_calls or []]
        assert deltas[0].id and deltas[0].function.name == "get_weather"
        assert "".join(d.function.arguments for d in deltas) == calls[0].function.arguments  # type: ignore[union-attr]
        required = client.chat.completions.create(
            **ask, seed=seed, tool_choice="required", parallel_tool_calls=False
        )  # type: ignore[call-overload]
        choice = required.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
        assert _valid_call(calls[0].function.name, calls[0].function.arguments), calls  # type: ignore[union-attr]


def test_auto_tool_choice_reads_deepseek_v3_calls_out_of_the_text(
    client: openai.OpenAI, cluster: Cluster, checkpoint: Path
) -> None:
    """ "auto" (the default with tools): text in DeepSeek-V3's call format becomes tool_calls,
    whole or streamed. A random model does not call by itself, so a regex makes it write one;
    the history of a call and its answer goes back through the template, counted as /tokenize
    counts it."""
    model = model_of(checkpoint)
    call = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json"
        '\\n\\{"city":"[a-z]{1,8}","metric":(true|false)\\}\\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = {
        "model": model,
        "messages": messages,
        "tools": [WEATHER, CLOCK],
        "seed": 3,
        "temperature": 1.0,
        "max_completion_tokens": 300,
        "extra_body": {"structured_outputs": {"regex": "Sure\\. " + call}},
    }
    reply = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    choice = reply.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert _valid_call("get_weather", calls[0].function.arguments)  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(**ask, stream=True))  # type: ignore[call-overload]
    content = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    deltas = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
    assert content == "Sure. " and len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.arguments == calls[0].function.arguments  # type: ignore[union-attr]
    assert [c.finish_reason for chunk in chunks for c in chunk.choices][-1] == "tool_calls"
    free = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        max_completion_tokens=8,
        seed=1,
    )
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "3C"},
    ]
    answer = client.chat.completions.create(
        model=model,
        messages=history,
        tools=[WEATHER],  # type: ignore[arg-type, list-item]
        max_completion_tokens=4,
    )
    status, counted = _post(
        cluster.gateway,
        json.dumps({"model": model, "messages": history, "tools": [WEATHER]}).encode(),
        "/tokenize",
    )
    assert status == 200 and answer.usage and counted["count"] == answer.usage.prompt_tokens
    assert answer.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not one of the tools (get_weather)",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "give no response_format",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools have the same name"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "String should match pattern",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "strin"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            'Unsupported type "strin"',
        ),
    ],
)
def test_contradictory_or_malformed_tool_requests_are_400(
    cluster: Cluster, checkpoint: Path, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {
        "model": model_of(checkpoint),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "tools": [WEATHER],
        **extra,
    }
    body = {k: v for k, v in body.items() if v is not None}
    status, out = _post(cluster.gateway, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == param, out
    assert message in out["error"]["message"], out


def test_continue_final_message_goes_on_with_the_last_turn(
    client: openai.OpenAI, cluster: Cluster, checkpoint: Path
) -> None:
    """continue_final_message: the prompt ends with the final message's text (no end of turn,
    no new turn), /tokenize and the chat request count it alike, and a bad combination is a
    400."""
    model, tok = model_of(checkpoint), load_tokenizer(checkpoint)
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    body = {"model": model, "messages": messages, **options}
    status, out = _post(cluster.gateway, json.dumps(body).encode(), "/tokenize")
    assert status == 200 and out["tokens"][-5:] == tok.encode("1 2 3", add_bos=False)
    reply = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=3,
        extra_body=options,
    )
    assert reply.usage and reply.usage.prompt_tokens == out["count"]
    for extra, message in [
        ({"add_generation_prompt": True}, "continue_final_message needs add_generation_prompt"),
        ({"chat_template_kwargs": {"tools": []}}, "tools: set by the request's own fields"),
        ({"messages": [{"role": "user", "content": " "}]}, "no text to go on with"),
    ]:
        status, err = _post(
            cluster.gateway,
            json.dumps(body | extra | {"max_tokens": 2}).encode(),
            "/v1/chat/completions",
        )
        assert status == 400 and message in err["error"]["message"], err
    status, err = _post(cluster.gateway, json.dumps(body | {"messages": []}).encode(), "/tokenize")
    assert status == 400 and "no final one" in err["error"]["message"], err


def test_truncate_prompt_tokens_keeps_the_prompts_end(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """vLLM's truncate_prompt_tokens: only the last k tokens are sent (-1: the context limit),
    counted so in the usage and echoed so; 0 or below -1 is a 400."""
    model = model_of(checkpoint)
    kw = {"model": model, "max_tokens": 2, "echo": True}
    cut = client.completions.create(
        prompt="abcdefghij",
        **kw,  # type: ignore[call-overload]
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text.startswith("ghij")
    assert not cut.choices[0].text.startswith("abc")
    whole = client.completions.create(
        prompt="abcdefghij",
        **kw,  # type: ignore[call-overload]
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert whole.usage.prompt_tokens == 11 and whole.choices[0].text.startswith("abcdefghij")
    messages = [{"role": "user", "content": "x" * 50}]
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=1,  # type: ignore[arg-type]
        extra_body={"truncate_prompt_tokens": 7},
    )
    assert chat.usage and chat.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="abc", **kw, extra_body={"truncate_prompt_tokens": 0})  # type: ignore[call-overload]
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "truncate_prompt_tokens"


def test_n_choices_and_seeded_sampling_reproduce(client: openai.OpenAI, checkpoint: Path) -> None:
    kw = {
        "model": model_of(checkpoint),
        "prompt": "Pick words:",
        "max_tokens": 8,
        "n": 2,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }
    first = client.completions.create(**kw)  # type: ignore[call-overload]
    second = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 16  # type: ignore[union-attr]


def test_a_batch_of_prompts_gives_n_choices_each_in_order(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    """prompt as a list (text or token ids): choice p * n + j is the j-th choice of prompt p,
    the same as that prompt alone; usage counts each prompt once."""
    tok = load_tokenizer(checkpoint)
    ids = tok.encode("Tokens already")
    kw = {
        "model": model_of(checkpoint),
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 9,
        "n": 2,
        "extra_body": {"ignore_eos": True},
    }
    alone = [client.completions.create(prompt=p, **kw) for p in ("Ship ahoy", ids)]  # type: ignore[call-overload]
    both = client.completions.create(prompt=[tok.encode("Ship ahoy"), ids], **kw)  # type: ignore[call-overload]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    assert both.usage is not None and both.usage.completion_tokens == 24
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    texts = client.completions.create(prompt=["Ship ahoy", "Land ho"], **kw)  # type: ignore[call-overload]
    assert [c.text for c in texts.choices[:2]] == [c.text for c in alone[0].choices]


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, checkpoint: Path) -> None:
    """The loglikelihood request of evaluation harnesses: token-id prompts in a batch, echo,
    logprobs=1, max_tokens=1. Each prompt token after the first has the logprob a forward over
    the whole prompt gives it (the engine in this process on the same checkpoint), streamed or
    not; the text is the prompt's, then the completion's."""
    tok = load_tokenizer(checkpoint)
    prompts = [tok.encode(t) for t in ("The river is wide", "and the ferry is slow to cross")]
    kw = {
        "model": model_of(checkpoint),
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "extra_body": {"ignore_eos": True},
    }
    out = client.completions.create(**kw)  # type: ignore[call-overload]
    engine = Engine(EngineConfig(model=str(checkpoint), block_size=16))
    refs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for choice, ids, ref in zip(out.choices, prompts, refs, strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.tokens == [
            tok.decode([t], skip_special_tokens=False) for t in [*ids, *ref.token_ids]
        ]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [next(iter(e.values())) for e in ref.prompt_logprobs or []]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, rel=1e-4, abs=1e-4)
        assert len(lp.token_logprobs) == len(ids) + 1 and len(lp.top_logprobs[1]) in (1, 2)
        head = tok.decode(ids, skip_special_tokens=False)
        assert choice.text == head + ref.text
        assert lp.text_offset is not None and lp.text_offset[-1] == len(head)
    chunks = list(client.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    for choice in out.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        streamed = [x for c in mine for x in (c.logprobs.token_logprobs or [])]  # type: ignore[union-attr]
        whole = choice.logprobs.token_logprobs  # type: ignore[union-attr]
        # equal up to float rounding: the two prompts' prefills may batch differently this time
        assert streamed[0] is None and whole[0] is None
        assert streamed[1:] == pytest.approx(whole[1:], rel=1e-5, abs=1e-5)


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, checkpoint: Path) -> None:
    kw = {
        "model": model_of(checkpoint),
        "prompt": "Count:",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    free = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    stop = free[5:7]
    assert len(stop) == 2
    out = client.completions.create(stop=[stop], **kw).choices[0]  # type: ignore[call-overload]
    assert out.finish_reason == "stop" and out.text == free[: free.index(stop)]


def test_logprobs_in_both_apis(client: openai.OpenAI, checkpoint: Path) -> None:
    out = client.completions.create(
        model=model_of(checkpoint),
        prompt="Log",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 5 and len(lp.token_logprobs or []) == 5
    # keyed by token text: byte tokens that are not UTF-8 on their own share "\ufffd"
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs or [])
    # greedy: the sampled token is the most likely one
    for sampled, top in zip(lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        assert sampled <= 0 and sampled >= max(top.values()) - 1e-5
    chat = client.chat.completions.create(
        model=model_of(checkpoint),
        max_tokens=4,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content), content


def test_models_health_and_metrics(
    cluster: Cluster, client: openai.OpenAI, checkpoint: Path
) -> None:
    (card,) = client.models.list()
    limits = [v.record.max_model_len for v in cluster.views("prefill")]
    assert card.id == model_of(checkpoint) and limits
    assert card.max_model_len == min(limits) and card.root == model_of(checkpoint)  # type: ignore[attr-defined]
    assert client.models.retrieve(model_of(checkpoint)).max_model_len == min(limits)  # type: ignore[attr-defined]
    with urllib.request.urlopen(cluster.gateway + "/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    with urllib.request.urlopen(cluster.gateway + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "ferry_gateway_time_to_first_token_seconds_count" in text
    assert "ferry_gateway_inter_token_latency_seconds_count" in text


@pytest.mark.parametrize(
    ("kw", "error", "param"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"temperature": -1.0}, openai.BadRequestError, "temperature"),
        ({"top_p": 3.0}, openai.BadRequestError, "top_p"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
        ({"n": 99}, openai.BadRequestError, "n"),
        ({"prompt": []}, openai.BadRequestError, "prompt"),
        ({"prompt": ["a", 1]}, openai.BadRequestError, "prompt"),
        ({"prompt": ["hi"] * 20, "n": 16}, openai.BadRequestError, "prompt"),
        ({"prompt": "x" * 2000}, openai.BadRequestError, "prompt"),
        ({"extra_body": {"not_a_field": 1}}, openai.BadRequestError, "not_a_field"),
        ({"logit_bias": {"abc": 1}}, openai.BadRequestError, "logit_bias"),  # the gateway's
        ({"logit_bias": {"5": 101}}, openai.BadRequestError, "logit_bias"),  # the scheduler's
        ({"logit_bias": {"99999": 1}}, openai.BadRequestError, "logit_bias"),  # the worker's
        ({"prompt": [1, 99999]}, openai.BadRequestError, "prompt"),  # the worker's too
        ({"extra_body": {"priority": 2**31}}, openai.BadRequestError, "priority"),
        ({"max_tokens": 2**31}, openai.BadRequestError, "max_tokens"),
        (  # the worker's, compiling the grammar
            {"extra_body": {"structured_outputs": {"regex": "(x"}}},
            openai.BadRequestError,
            "response_format",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_errors_raise_the_matching_openai_exception(
    client: openai.OpenAI,
    checkpoint: Path,
    kw: dict[str, object],
    error: type,
    param: str,
    stream: bool,
) -> None:
    """Streamed too: the status line waits for the scheduler's first chunk, so a refusal is an
    HTTP error (vLLM's behaviour), not a 200 with the error in the stream."""
    args: dict[str, object] = {"model": model_of(checkpoint), "prompt": "hi", "max_tokens": 4}
    args.update(kw, stream=stream)
    with pytest.raises(error) as info:
        out = client.completions.create(**args)  # type: ignore[call-overload]
        list(out) if stream else None
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert body["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_gone_before_its_answer_frees_the_request(
    cluster: Cluster, checkpoint: Path, path: str
) -> None:
    """Not streamed: the client hangs up while the answer is being generated; the request is
    aborted on its worker and its blocks freed, as a streamed one's are."""
    body: dict[str, object] = {"model": model_of(checkpoint), "max_tokens": 900}
    body["ignore_eos"] = True
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "go on"}]
    else:
        body["prompt"] = "go on"
    data = json.dumps(body).encode()
    host, port = cluster.gateway.removeprefix("http://").split(":")

    def decoding() -> float:
        return cluster.metric("decode-0", "ferry_engine_requests_running")

    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        cluster.wait_for("the request decoding", lambda: decoding() >= 1, 30)
    cluster.wait_for("the request aborted", lambda: decoding() == 0, 10)
    cluster.wait_for("blocks free", cluster.all_blocks_free, 10)


def _post(url: str, data: bytes, path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if not isinstance(data, bytes):  # an iterable body goes out chunked
        headers["Transfer-Encoding"] = "chunked"
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_gives_the_ids_a_request_is_sent_as_and_detokenize_reverses_them(
    client: openai.OpenAI, cluster: Cluster, checkpoint: Path
) -> None:
    """vLLM's /tokenize and /detokenize: a prompt's ids, a chat's ids as the chat request counts
    them, and the context limit of the workers that requests start on."""
    model, tok = model_of(checkpoint), load_tokenizer(checkpoint)

    def post(path: str, **body: object) -> tuple[int, dict[str, Any]]:
        return _post(cluster.gateway, json.dumps({"model": model, **body}).encode(), path)

    status, out = post("/tokenize", prompt="The ferry", return_token_strs=True)
    assert (
        status == 200
        and out["tokens"] == tok.encode("The ferry")
        and out["count"] == len(out["tokens"])
    )
    assert out["token_strs"] == [tok.decode([t], skip_special_tokens=False) for t in out["tokens"]]
    limits = [v.record.max_model_len for v in cluster.views("prefill")]
    assert limits and out["max_model_len"] == min(limits)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    status, chat = post("/tokenize", messages=messages)
    reply = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=1)  # type: ignore[arg-type]
    assert status == 200 and reply.usage and chat["count"] == reply.usage.prompt_tokens
    assert chat["token_strs"] is None
    status, back = post("/detokenize", tokens=out["tokens"])
    assert status == 200 and back == {
        "prompt": tok.decode(out["tokens"], skip_special_tokens=False)
    }
    status, err = post("/detokenize", tokens=[1, 10**6])
    assert status == 400 and err["error"]["param"] == "tokens"
    assert "token id 1000000 is outside the tokenizer's vocabulary" in err["error"]["message"]
    status, err = post("/tokenize")
    assert status == 400 and "give either prompt or messages" in err["error"]["message"]


def test_malformed_json_is_400(cluster: Cluster) -> None:
    status, body = _post(cluster.gateway, b'{"model": "m", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]  # type: ignore[index]


def test_client_disconnect_mid_stream_frees_the_blocks(
    cluster: Cluster, client: openai.OpenAI, checkpoint: Path
) -> None:
    stream = client.completions.create(
        model=model_of(checkpoint),
        prompt="Long one",
        stream=True,
        max_tokens=800,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    cluster.wait_for("blocks free after disconnect", cluster.all_blocks_free, 10)


def _gateway(scheduler: str, model: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """A `ferry serve gateway` of its own (its gRPC port is kept in _GRPC_PORTS)."""
    port, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "ferry.infra.cli",
        "serve",
        "gateway",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--scheduler",
        scheduler,
        "--model",
        model,
        *extra,
    ]
    _GRPC_PORTS[port] = grpc_port
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert proc.poll() is None, "the gateway exited"
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # 401 with a key: it answers
        except OSError:
            return False
        return True

    wait_until("the gateway answers", answers, 60, every=0.2)
    return proc, url


def test_api_key_and_body_limit(cluster: Cluster, checkpoint: Path) -> None:
    proc, url = _gateway(
        cluster.scheduler, str(checkpoint), "--api-key", "sesame", "--max-body-bytes", "1000"
    )
    try:
        status, body = _post(url, b"x" * 4000)  # refused before it is read or parsed
        assert status == 413 and body["error"]["code"] == "request_too_large"  # type: ignore[index]
        chunked = iter([b"x" * 600, b"y" * 600])  # no Content-Length: counted as it arrives
        status, body = _post(url, chunked)  # type: ignore[arg-type]
        assert status == 413 and body["error"]["code"] == "request_too_large"  # type: ignore[index]
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        out = good.completions.create(model=str(checkpoint), prompt="ok", max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens >= 1
        grpc_address = f"127.0.0.1:{_GRPC_PORTS[int(url.rsplit(':', 1)[1])]}"
        with FerryClient(grpc_address, api_key="wrong") as sdk, pytest.raises(AuthenticationError):
            sdk.models()
        with FerryClient(grpc_address, api_key="sesame") as sdk:
            assert sdk.complete("ok", max_tokens=2).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_ferry_up_gives_the_gateway_its_key_off_the_command_line(
    redis: RedisServer, checkpoint: Path
) -> None:
    args = ("--aggregated", "1", "--model", str(checkpoint), "--api-key", "sesame")
    with ferry_up(redis.url, *args, cluster="keyed") as c:
        (pid,) = c.children()["gateway"]
        assert b"sesame" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"FERRY_API_KEY=sesame" in Path(f"/proc/{pid}/environ").read_bytes()
        keyless = openai.OpenAI(base_url=c.gateway + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            keyless.models.list()
        keyed = openai.OpenAI(base_url=c.gateway + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in keyed.models.list()] == [str(checkpoint)]


def test_a_reasoning_parser_splits_thinking_from_the_answer(
    cluster: Cluster, checkpoint: Path
) -> None:
    """--reasoning-parser deepseek_r1: the text before </think> is reasoning_content, whole or
    streamed, and the answer after it is read on for tool calls, here in DeepSeek-V3.1's format
    (--tool-call-parser deepseek_v31). A random model does not think by itself, so a regex
    makes it write R1's shape."""
    call = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>"
        '\\{"zone":"utc"\\}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    shape = "<think>\\n[a-z]{3,9}( [a-z]{2,6}){2}\\n</think>\\n\\n"
    proc, url = _gateway(
        cluster.scheduler,
        str(checkpoint),
        "--reasoning-parser",
        "deepseek_r1",
        "--tool-call-parser",
        "deepseek_v31",
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = {
            "model": model_of(checkpoint),
            "messages": [{"role": "user", "content": "Why?"}],
            "seed": 4,
            "temperature": 1.0,
            "max_completion_tokens": 400,
        }
        reply = client.chat.completions.create(
            **ask, extra_body={"structured_outputs": {"regex": shape + "Because [a-z]{2,8}\\."}}
        )  # type: ignore[call-overload]
        message = reply.choices[0].message
        thought: str = message.reasoning_content  # type: ignore[attr-defined]
        assert re.fullmatch("\n[a-z]{3,9}( [a-z]{2,6}){2}\n", thought), thought
        assert re.fullmatch("\n\nBecause [a-z]{2,8}\\.", message.content or ""), message
        chunks = list(
            client.chat.completions.create(
                **ask,
                stream=True,
                extra_body={"structured_outputs": {"regex": shape + "Because [a-z]{2,8}\\."}},
            )
        )  # type: ignore[call-overload]
        deltas = [c.delta for chunk in chunks for c in chunk.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == message.content
        tool = client.chat.completions.create(
            **ask, tools=[CLOCK], extra_body={"structured_outputs": {"regex": shape + call}}
        )  # type: ignore[call-overload]
        choice = tool.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "\n\n"
        assert choice.message.reasoning_content  # type: ignore[attr-defined]
        calls = choice.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("now", '{"zone":"utc"}')
        ]  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    plain = openai.OpenAI(base_url=cluster.gateway + "/v1", api_key="unused", max_retries=0)
    reply = plain.chat.completions.create(  # no parser: the thinking is content
        **ask, extra_body={"structured_outputs": {"regex": shape + "Because [a-z]{2,8}\\."}}
    )  # type: ignore[call-overload]
    assert reply.choices[0].message.content.startswith("<think>")  # type: ignore[union-attr]
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None


def test_no_scheduler_is_503_and_not_ready(checkpoint: Path) -> None:
    """/health says so at once; a request waits --scheduler-wait for one to come up, then 503."""
    proc, url = _gateway(f"127.0.0.1:{free_port()}", str(checkpoint), "--scheduler-wait", "1")
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=5)
        assert info.value.code == 503
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=str(checkpoint), prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        assert err.value.body["code"] == "scheduler_unavailable", err.value.body  # type: ignore[index]
        assert "did not answer within 1 s" in err.value.message
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_requests_take_turns_on_the_scheduler_replicas(
    cluster: Cluster, client: openai.OpenAI, checkpoint: Path
) -> None:
    """`ferry up --schedulers 2`: the gateway sends one request at a time to each in turn."""
    ok = 'ferry_scheduler_requests_total{outcome="ok"}'
    names = ("scheduler-0", "scheduler-1")
    before = [cluster.metric(n, ok) for n in names]
    for i in range(6):
        client.completions.create(model=model_of(checkpoint), prompt=f"turn {i}", max_tokens=2)
    assert [cluster.metric(n, ok) - b for n, b in zip(names, before, strict=True)] == [3, 3]


def _gateway_metric(cluster: Cluster, name: str) -> float:
    with urllib.request.urlopen(cluster.gateway + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith(name + " "))


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_stream_whose_scheduler_dies_or_hangs_goes_on_through_the_other_replica(
    cluster: Cluster, client: openai.OpenAI, checkpoint: Path, how: signal.Signals
) -> None:
    """kill -9 of the scheduler replica streaming a seeded request (--migration-limit 1), or
    SIGSTOP (no error and no tokens: the gateway's keepalive pings go unanswered and it drops
    the connection): the gateway sends the prompt + the tokens sent to the other replica, and
    the client gets the same text and usage as an undisturbed run."""
    kw = {
        "model": model_of(checkpoint),
        "prompt": "Carry me across the water",
        "max_tokens": 600,
        "temperature": 0.8,
        "seed": 2024,
        "presence_penalty": 0.2,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    moves = _gateway_metric(cluster, "ferry_gateway_migrations_total")
    chunks, victim = [], ""
    try:
        stream = client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )  # type: ignore[call-overload]
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                running = "ferry_scheduler_running_requests"
                (victim,) = [
                    n for n in ("scheduler-0", "scheduler-1") if cluster.metric(n, running)
                ]
                cluster.signal(victim, how)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text, cluster.log_tail()
        usage = chunks[-1].usage
        assert usage is not None and whole.usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 600)
        assert cluster.logged('"event": "scheduler_connection_lost"')
        assert _gateway_metric(cluster, "ferry_gateway_migrations_total") == moves + 1
    finally:
        if victim and how is signal.SIGSTOP:
            cluster.signal(victim, signal.SIGCONT)
    # the cluster whole again for the tests after this one
    if how is signal.SIGKILL:
        cluster.restarted(victim, 60)  # `ferry up` starts it again
    else:
        names = lambda: {v.record.worker_id for v in cluster.views("scheduler")}  # noqa: E731
        cluster.wait_for(f"{victim} registered", lambda: victim in names(), 10)
    cluster.wait_for("blocks freed", cluster.all_blocks_free, 15)


def test_a_gateway_with_a_dead_scheduler_replica_serves_through_the_live_one(
    cluster: Cluster, checkpoint: Path
) -> None:
    """Given a dead scheduler address and a live one, the gateway is ready and serves every
    request (tests/unit/test_scheduler_pool.py shows the dead one is not even tried)."""
    dead = f"127.0.0.1:{free_port()}"
    proc, url = _gateway(f"{dead},{cluster.scheduler}", str(checkpoint), "--scheduler-wait", "1")
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            assert reply.status == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for i in range(4):
            out = c.completions.create(model=str(checkpoint), prompt=f"live {i}", max_tokens=2)
            assert out.usage is not None and out.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_a_full_cluster_is_429_with_retry_after(redis: RedisServer, checkpoint: Path) -> None:
    """One decode slot (--max-num-seqs 1): while a long stream holds it, another request is
    refused by the decode worker, retried by the scheduler, and ends as 429."""
    args = (
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        "256",
        "--worker-args",
        f"{WORKER_ARGS} --max-num-seqs 1",
    )
    with ferry_up(redis.url, *args, cluster="full") as c:
        client = openai.OpenAI(base_url=c.gateway + "/v1", api_key="x", max_retries=0)
        holder = client.completions.create(
            model=str(checkpoint),
            prompt="hold",
            stream=True,
            max_tokens=900,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(holder):
            if i == 3:
                break
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=str(checkpoint), prompt="me too", max_tokens=4)
        assert info.value.response.headers["retry-after"] == "1"
        assert "is full" in info.value.message
        holder.close()
