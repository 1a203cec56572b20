"""A request resumed on another engine after k generated tokens (request migration: the prompt
now ends with them, ``Resumed`` says how many and how much of their text the client has)
continues with the same tokens and the same text as one that never moved: held-back text is
released, and a stop string that spans the move is still found. DeepSeek-V3 and -V4 alike (V4's
state is recomputed from the prompt, exactly)."""

from __future__ import annotations

import dataclasses

import pytest

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.request import RequestOutput, Resumed

PROMPT = list(b"Hello there, ")


@pytest.fixture(scope="module", params=["tiny", "v4-tiny"])
def engine(request: pytest.FixtureRequest) -> Engine:
    return Engine(EngineConfig(model=request.param, block_size=16, num_kv_blocks=256))


def _run(
    engine: Engine, prompt: list[int], params: SamplingParams, resumed: Resumed | None = None
) -> list[RequestOutput]:
    """Every output of one request, step by step (each carries that step's delta)."""
    engine.add_request("r", prompt, params, resumed=resumed)
    outs: list[RequestOutput] = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == "r"]
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.delta_token_ids]


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.delta_text for o in outs)


def _moved_after(
    engine: Engine, k: int, params: SamplingParams
) -> tuple[list[int], str, RequestOutput]:
    """Run ``params`` for k tokens, then resume it on the engine as the scheduler does."""
    first = _run(engine, PROMPT, params)[:k]  # what the failed worker had streamed
    generated, emitted = _tokens(first), _text(first)
    assert len(generated) == k
    rest = dataclasses.replace(
        params,
        max_tokens=params.max_tokens - k,  # type: ignore[operator]
        min_tokens=max(0, params.min_tokens - k),
    )
    outs = _run(engine, PROMPT + generated, rest, Resumed(k, len(emitted)))
    return generated + _tokens(outs), emitted + _text(outs), outs[-1]


def test_a_resumed_request_continues_with_the_same_tokens_and_text(engine: Engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    whole = _run(engine, PROMPT, params)
    assert "\ufffd" in _text(whole)  # the tiny model's bytes: some are cut UTF-8 sequences
    for k in (1, 2, 5, 9, 16, 23):
        tokens, text, last = _moved_after(engine, k, params)
        assert tokens == _tokens(whole), k
        assert text == _text(whole) and last.finish_reason == "length", k


def test_seeded_sampling_and_penalties_go_on_as_if_it_had_not_moved(engine: Engine) -> None:
    """A seeded draw depends on the seed and the output token's place, and the presence /
    frequency penalties count what was generated before the move as output."""
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        max_tokens=24,
        ignore_eos=True,
    )
    whole = _run(engine, PROMPT, params)
    assert _run(engine, PROMPT, dataclasses.replace(params, seed=8)) != whole
    for k in (1, 6, 17):
        tokens, text, _ = _moved_after(engine, k, params)
        assert (tokens, text) == (_tokens(whole), _text(whole)), k


def test_a_stop_string_across_the_move_is_found(engine: Engine) -> None:
    """The stop string's first character was generated (and held back) before the move."""
    whole = _text(_run(engine, PROMPT, SamplingParams(temperature=0, max_tokens=24)))
    stop = whole[8:11]
    params = SamplingParams(temperature=0, max_tokens=24, stop=(stop,))
    outs = _run(engine, PROMPT, params)
    assert outs[-1].finish_reason == "stop" and len(_tokens(outs)) > 9
    tokens, text, last = _moved_after(engine, 9, params)
    assert (tokens, text) == (_tokens(outs), _text(outs))
    assert last.finish_reason == "stop" and last.stop_reason == stop


def test_a_resume_that_covers_the_whole_prompt_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"num_output_tokens is 3; it must be 1\.\.2"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(), resumed=Resumed(3, 0))
    assert "bad" not in engine.requests
