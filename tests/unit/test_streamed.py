"""Streamed: the request that goes on after what a client was sent. A move of a move (the
gateway's, then the scheduler's) must be the same request as one move of everything."""

from __future__ import annotations

from ferry.protos import common_pb2, scheduler_pb2
from ferry.services.common.streamed import Streamed


def _chunk(*ids: int, text: str) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(token_ids=ids, text=text)


def test_a_continuation_of_a_continuation_is_one_continuation() -> None:
    params = common_pb2.SamplingParams(
        max_tokens=10, min_tokens=4, temperature=0.0, prompt_logprobs=1
    )
    request = scheduler_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=params
    )
    once = Streamed()
    for c in (_chunk(7, 8, text="ab"), _chunk(9, text="c"), _chunk(5, 6, text="de")):
        once.add(c)
    whole = once.rest(request)

    first = Streamed()
    first.add(_chunk(7, 8, text="ab"))
    first.add(_chunk(9, text="c"))
    part = first.rest(request)  # e.g. the gateway's, after the scheduler went away
    second = Streamed.after(part)
    assert (second.before, second.chars_before) == (3, 3)
    second.add(_chunk(5, 6, text="de"))
    assert second.rest(part) == whole  # e.g. the scheduler's, after a worker went away

    assert list(whole.prompt_token_ids) == [1, 2, 3, 7, 8, 9, 5, 6]
    assert (whole.resumed.num_output_tokens, whole.resumed.num_emitted_chars) == (5, 5)
    assert (whole.sampling_params.max_tokens, whole.sampling_params.min_tokens) == (5, 0)
    assert whole.sampling_params.temperature == 0.0
    # the client has the prompt's logprobs from the first chunk; the rest asks for none
    assert not whole.sampling_params.HasField("prompt_logprobs")


def test_usage_counts_the_whole_request_after_moves() -> None:
    request = scheduler_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3, 4])
    s = Streamed()
    s.add(_chunk(5, 6, text="xy"))
    part = s.rest(request)
    after = Streamed.after(part)
    after.add(_chunk(7, text="z"))
    usage = common_pb2.Usage(prompt_tokens=6, completion_tokens=1, cached_tokens=6)
    after.count_usage(usage, part)  # the last part's worker saw a 6-token prompt
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (4, 3, 4)


def test_no_max_tokens_stays_unset() -> None:
    request = scheduler_pb2.GenerateRequest(prompt_token_ids=[1], sampling_params={})
    s = Streamed()
    s.add(_chunk(2, text="b"))
    assert not s.rest(request).sampling_params.HasField("max_tokens")
