"""Sampler: filters, penalties, seeds and logprobs on hand-made logits."""

from __future__ import annotations

import math

import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.engine.sampler import Sampler
from tests.helpers import make_request


def req(params: SamplingParams, prompt: list[int] | None = None, out: list[int] | None = None):  # type: ignore[no-untyped-def]
    r = make_request("r", prompt or [0])
    r.params = params
    r.output_token_ids = list(out or [])
    return r


LOGITS = torch.tensor([[0.0, 3.0, 2.5, 1.0, -1.0]])


def test_greedy_and_filters_that_leave_one_token() -> None:
    s = Sampler(eos_token_ids=[4])
    for p in [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-3),
        SamplingParams(temperature=1.0, min_p=0.99),
    ]:
        for _ in range(5):
            assert s(LOGITS, [req(p)]).token_ids == [1], p


def test_top_k_limits_the_support() -> None:
    s = Sampler(eos_token_ids=[], seed=1)
    seen = {
        s(LOGITS, [req(SamplingParams(temperature=5.0, top_k=2))]).token_ids[0] for _ in range(200)
    }
    assert seen == {1, 2}


def test_penalties() -> None:
    s = Sampler(eos_token_ids=[])
    # token 1 was generated twice: a frequency penalty of 1 takes it from 3.0 to 1.0 < 2.5
    assert s(
        LOGITS, [req(SamplingParams(temperature=0, frequency_penalty=1.0), out=[1, 1])]
    ).token_ids == [2]
    assert s(
        LOGITS, [req(SamplingParams(temperature=0, presence_penalty=0.6), out=[1])]
    ).token_ids == [2]
    # repetition penalty divides positive logits of seen tokens (prompt included)
    assert s(
        LOGITS, [req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1])]
    ).token_ids == [2]


def test_min_tokens_masks_stop_tokens() -> None:
    s = Sampler(eos_token_ids=[1])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert s(LOGITS, [req(p, out=[3])]).token_ids == [3]  # eos 1 and stop 2 are masked
    assert s(LOGITS, [req(p, out=[3, 3])]).token_ids == [1]


def test_logit_bias_is_added_before_sampling_and_leaves_logprobs_raw() -> None:
    s = Sampler(eos_token_ids=[], seed=2)
    raw = torch.log_softmax(LOGITS[0], dim=-1)
    forced = SamplingParams(temperature=0, logit_bias={4: 100.0}, logprobs=0)
    out = s(LOGITS, [req(forced)])
    assert out.token_ids == [4] and out.logprobs == [{4: float(raw[4])}]
    banned = SamplingParams(temperature=0, logit_bias={1: -100.0, 2: -100.0})
    assert s(LOGITS, [req(banned)]).token_ids == [3]
    # sampled: the bias moves the distribution (2 over 1), and 1 is never drawn when banned
    tilted = SamplingParams(temperature=1.0, logit_bias={1: -100.0, 3: 5.0})
    seen = {s(LOGITS, [req(tilted)]).token_ids[0] for _ in range(100)}
    assert 1 not in seen and 3 in seen
    # a row without bias beside a biased one is untouched
    both = s(LOGITS.repeat(2, 1), [req(forced), req(SamplingParams(temperature=0))])
    assert both.token_ids == [4, 1]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    s = Sampler(eos_token_ids=[])
    logits = torch.randn(33, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = s(logits[:1], [req(p)]).token_ids[0]
    batch = [req(SamplingParams(temperature=1.0)) for _ in range(32)]
    assert s(logits, [req(p), *batch]).token_ids[0] == alone


def test_a_seeded_draw_depends_on_the_output_tokens_place_only() -> None:
    """The same seed at the same output place draws the same token, on any sampler, however
    many draws came before; other places draw other tokens."""
    logits = torch.zeros(1, 1000)  # uniform: the draw is the exponential race alone
    p = SamplingParams(temperature=1.0, seed=99)
    draws = [
        Sampler([], seed=s)(logits, [req(p, out=[0] * i)]).token_ids[0]
        for s in range(3)
        for i in range(8)
    ]
    assert draws[:8] == draws[8:16] == draws[16:]
    assert len(set(draws[:8])) == 8
    moved = req(p, prompt=[0] * 9, out=[0, 0])
    moved.num_resumed = 5  # 5 generated before a move and 2 since: the draw for token 7
    assert Sampler([])(logits, [moved]).token_ids[0] == draws[7]


def test_logprobs_from_raw_logits() -> None:
    s = Sampler(eos_token_ids=[])
    res = s(
        LOGITS, [req(SamplingParams(temperature=0, logprobs=2, frequency_penalty=1.0), out=[1, 1])]
    )
    lp = res.logprobs[0]
    assert lp is not None and res.token_ids == [2]
    expect = torch.log_softmax(LOGITS[0], dim=-1)
    assert set(lp) == {1, 2}  # sampled (2) plus the top 2 (1, 2) of the raw logits
    assert math.isclose(lp[2], float(expect[2]), rel_tol=1e-6)
