"""Structured outputs: whatever the (random) model prefers, the text matches the grammar, and the
request ends at the grammar's end. Sampled at temperature 1 with several seeds, so that a mask
that let one wrong token through would show."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from ferry.services.common.sampling_params import StructuredOutput
from ferry.services.common.tokenizer import load_tokenizer, write_byte_tokenizer_json
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.request import Resumed
from ferry.services.engine.structured import Grammars, mask_logits

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
    },
    "required": ["ok", "colour", "tag", "scores"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}"),
    "choice": StructuredOutput("choice", choices=("yes", "no", 'say "maybe"')),
    "grammar": StructuredOutput("grammar", 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'),
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=256))


def _matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        value = json.loads(text)
        return (
            set(value) == set(SCHEMA["properties"])
            and isinstance(value["ok"], bool)  # type: ignore[arg-type]
            and value["colour"] in ("red", "green", "blue")
            and re.fullmatch("[a-z]{1,6}", value["tag"]) is not None
            and len(value["scores"]) <= 3
            and all(0 <= s <= 9 for s in value["scores"])
        )
    if kind == "regex":
        return re.fullmatch(r"[a-c]{3}-[0-9]{2}", text) is not None
    if kind == "choice":
        return text in SPECS["choice"].choices
    return re.fullmatch(r"\([0-9](\+[0-9])*\)", text) is not None


@pytest.mark.parametrize("kind", list(SPECS))
def test_sampled_text_matches_the_grammar_and_ends_with_it(engine: Engine, kind: str) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_output=SPECS[kind])
        for s in range(6)
    ]
    outs = engine.generate(["Answer: "] * 6, params)
    for out in outs:
        assert out.finish_reason == "stop", (kind, out.text)
        assert _matches(kind, out.text), (kind, out.text)
        assert out.token_ids[-1] in engine.eos_token_ids  # the grammar's end is EOS
    assert len({o.text for o in outs}) > 1  # the draws differ: the mask did the constraining


def test_json_object_is_an_object_even_greedy(engine: Engine) -> None:
    """Greedy decoding of a random model, left alone, never writes JSON."""
    spec = StructuredOutput("json_object")
    out = engine.generate(["x"], SamplingParams(temperature=0, max_tokens=300))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=400, structured_output=spec)
        for s in range(4)
    ]
    for out in engine.generate(["x"] * 4, params):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # a long object cut at max_tokens is still an object's beginning
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_a_resumed_request_keeps_its_grammar_state(engine: Engine) -> None:
    """Request migration replays the generated tokens into the new engine's matcher."""
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=200, structured_output=SPECS["json_schema"]
    )
    prompt = engine.tokenizer.encode("Answer: ")
    whole = engine.generate([prompt], params)[0]
    k = 7
    rest = dataclasses.replace(params, max_tokens=200 - k)
    engine.add_request("moved", prompt + whole.token_ids[:k], rest, resumed=Resumed(k, 0))
    tokens = list(whole.token_ids[:k])
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.delta_token_ids]
    assert tokens == whole.token_ids
    with pytest.raises(ValueError, match="do not fit its structured output"):
        bad = prompt + engine.tokenizer.encode("[1]", add_bos=False)
        engine.add_request("bad", bad, rest, resumed=Resumed(3, 0))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput("json_schema", '{"type": 5}'), r"\(json_schema\) does not compile: "),
        (StructuredOutput("json_schema", "not json"), r"\(json_schema\) does not compile: "),
        (StructuredOutput("regex", "(ab"), r"\(regex\) does not compile: .*parenthesis"),
        (StructuredOutput("grammar", "root ::= "), r"\(grammar\) does not compile: "),
    ],
)
def test_a_spec_that_does_not_compile_is_refused(
    engine: Engine, spec: StructuredOutput, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as e:
        engine.add_request("bad", [1, 2], SamplingParams(structured_output=spec))
    assert "/project/" not in str(e.value)  # xgrammar's source location is cut
    assert "bad" not in engine.requests


def test_spec_and_params_checks() -> None:
    with pytest.raises(ValueError, match="at least one non-empty choice"):
        StructuredOutput("choice", choices=("a", ""))
    with pytest.raises(ValueError, match=r"\(regex\) is empty"):
        StructuredOutput("regex")
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput("json_object"))


def test_a_tokenizer_json_vocabulary_never_offers_special_tokens(tmp_path: Path) -> None:
    """tokenizer.json's special tokens are text to xgrammar unless marked: a grammar could
    then spell '<|reserved_300|>' inside a string, which the detokenizer drops."""
    write_byte_tokenizer_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    grammars = Grammars(load_tokenizer(tmp_path), 384, (257,))
    matcher = grammars.matcher(StructuredOutput("regex", r"<[^>]*>"))
    assert matcher.accept_token(ord("<"))
    logits = torch.zeros(1, 384)
    mask_logits(logits, [matcher])
    allowed = set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())
    assert ord(">") in allowed and ord("a") in allowed
    assert not allowed & set(range(256, 384))  # no special token, and not EOS mid-way
