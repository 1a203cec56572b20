"""Engine behaviour on the tiny preset: prefix caching, seeds, stops, aborts, rejections."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.model import prompt_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=256))


def _all_free_or_cached(engine: Engine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage()["in_use"] == 0


def test_prefix_cache_hit_gives_same_tokens(engine: Engine) -> None:
    shared = list(range(100, 200))
    first, second = [*shared, 1, 2, 3], [*shared, 7, 8]
    engine.generate([first], GREEDY)
    hit = engine.generate([second], GREEDY)[0]
    assert hit.num_cached_tokens == 96  # six full 16-token blocks of the shared prefix
    cold = Engine(EngineConfig(model="tiny", block_size=16, enable_prefix_caching=False))
    miss = cold.generate([second], GREEDY)[0]
    assert miss.num_cached_tokens == 0
    assert hit.token_ids == miss.token_ids
    _all_free_or_cached(engine)
    _all_free_or_cached(cold)


def test_seeded_sampling_alone_and_in_a_batch(engine: Engine) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = engine.generate(["The ferry leaves at"], seeded)[0]
    others = [f"other prompt {i} " * (i % 5 + 1) for i in range(32)]
    noisy = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = engine.generate(["The ferry leaves at", *others], [seeded] + [noisy] * 32)
    assert outs[0].token_ids == alone.token_ids
    _all_free_or_cached(engine)


def test_stop_string_is_matched_on_text_and_not_emitted(engine: Engine) -> None:
    base = engine.generate(
        ["stop strings"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0]
    text = base.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = text.index(stop)
    out = engine.generate(
        ["stop strings"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    assert out.token_ids == base.token_ids[: len(out.token_ids)] and len(out.token_ids) < 30
    _all_free_or_cached(engine)


def test_stop_token_and_min_tokens(engine: Engine) -> None:
    base = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )[0]
    stop_id = base.token_ids[4]
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    p = SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[base.token_ids[0]], min_tokens=3
    )
    late = engine.generate([[5, 6, 7]], p)[0]
    assert len(late.token_ids) >= 3 and base.token_ids[0] not in late.token_ids[:3]


def _streamed(engine: Engine, prompt: str, params: SamplingParams) -> tuple[str, str]:
    """The deltas joined, and the final output's text."""
    engine.add_request("streamed", engine.tokenizer.encode(prompt), params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.delta_text
    return text, out.text


def test_include_stop_str_in_output(engine: Engine) -> None:
    """vLLM's include_stop_str_in_output: the stop string ends the text (text after it in the
    same token is cut), and a stop token's text is emitted; by default neither is."""
    base = engine.generate(
        ["stop strings"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0]
    text = base.text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    cut = text.index(stop) + len(stop)
    p = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        stop=[stop, "never seen"],
        include_stop_str_in_output=True,
    )
    streamed, whole = _streamed(engine, "stop strings", p)
    assert streamed == whole == text[:cut]
    ids = base.token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    for include in (False, True):
        p = SamplingParams(
            temperature=0,
            max_tokens=30,
            stop_token_ids=[stop_id],
            include_stop_str_in_output=include,
        )
        streamed, whole = _streamed(engine, "stop strings", p)
        want = engine.tokenizer.decode(ids[: first + include])
        assert streamed == whole == want, include
    _all_free_or_cached(engine)


def test_logprobs_and_incremental_step_outputs(engine: Engine) -> None:
    engine.add_request(
        "lp", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    )
    deltas: list[int] = []
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas += out.delta_token_ids
            text += out.delta_text
    assert out.finished and deltas == out.token_ids and text == out.text
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert token in lp and 3 <= len(lp) <= 4 and lp[token] == max(lp.values())


def test_priority_orders_admission_and_preemption() -> None:
    """Lower priority values are admitted first and preempted last; equal ones stay FCFS."""
    engine = Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=8, max_num_seqs=1))
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("first", [5] * 20, p)
    engine.step()  # "first" runs; the rest wait for its one seat
    for rid, priority in (("b", 0), ("c", -1), ("d", 0), ("e", -1)):
        engine.add_request(rid, [6] * 20, replace(p, priority=priority))
    started: list[str] = []
    while engine.has_unfinished_requests():
        started += [o.request_id for o in engine.step() if o.request_id not in started]
    assert started == ["first", "c", "e", "b", "d"]

    engine = Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=8))
    grow = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("low", [7] * 40, replace(grow, priority=5))
    low = engine.requests["low"]
    engine.step()
    engine.add_request("high", [8] * 40, grow)  # younger, but ahead in priority
    high = engine.requests["high"]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    # both need 7 of the 8 blocks: one is preempted, and it is the one of lower priority
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    assert len(outs["low"].token_ids) == len(outs["high"].token_ids) == 60
    engine.check_integrity()


def test_abort_frees_blocks(engine: Engine) -> None:
    engine.add_request("a", list(range(300)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.usage()["in_use"] > 0
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert engine.abort("a") is None
    _all_free_or_cached(engine)


def test_rejections(engine: Engine) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("v", [1, 10_000], GREEDY)
    with pytest.raises(ValueError, match="logit_bias token id 10000 is outside the vocabulary"):
        engine.add_request("b", [1], SamplingParams(logit_bias={5: 1.0, 10_000: 1.0}))
    with pytest.raises(ValueError, match="exceeds the model's limit of 4096"):
        engine.add_request("l", [1] * 4000, SamplingParams(max_tokens=100))
    small = Engine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=4))
    with pytest.raises(ValueError, match="need 5 KV blocks; the cache has 4"):
        small.add_request("b", [1] * 70, SamplingParams(max_tokens=10))
    engine.add_request("dup", [1], GREEDY)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", [1], GREEDY)
    engine.abort("dup")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="block_size=8"):
        EngineConfig(block_size=8)
    _all_free_or_cached(engine)


def test_prompt_logprobs_are_the_models_and_skip_the_prefix_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunked (32-token budget, a 100-token prompt, logits 7 rows at a time) and with the
    prompt already cached: every prompt token after the first gets the logprob of one forward
    over the whole prompt, then the top 3; the cached prefix is computed again (it has no
    logits to give)."""
    monkeypatch.setattr("ferry.services.engine.model_runner.PROMPT_LOGPROB_ROWS", 7)
    engine = Engine(
        EngineConfig(model="tiny", block_size=16, num_kv_blocks=256, max_num_batched_tokens=32)
    )
    prompt = list(range(40, 140))
    engine.generate([prompt], GREEDY)
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    plain, out = engine.generate([prompt, prompt], [GREEDY, asked])
    assert plain.num_cached_tokens == 96 and plain.prompt_logprobs is None
    assert out.num_cached_tokens == 0 and out.prompt_logprobs is not None
    lp = torch.log_softmax(prompt_logits(engine.model, prompt), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    for i, entry in enumerate(out.prompt_logprobs):
        token = prompt[i + 1]
        assert next(iter(entry)) == token
        top = lp[i].topk(3)
        want = {token: lp[i, token], **dict(zip(top.indices.tolist(), top.values, strict=True))}
        assert entry.keys() == want.keys(), i
        for t, v in want.items():
            assert abs(entry[t] - float(v)) < 1e-4, (i, t)
    assert out.token_ids == plain.token_ids[:2]
    _all_free_or_cached(engine)


def test_small_eager_steps_run_on_one_thread() -> None:
    """``one_thread_below``: a step of fewer new tokens runs on one torch thread, a larger one
    on the engine's, and the greedy tokens do not change."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = EngineConfig(model="tiny", block_size=16, num_kv_blocks=256, one_thread_below=64)
        engine = Engine(config)
        seen: list[tuple[int, int]] = []  # (tokens in the step, threads during its forward)
        engine.model.register_forward_pre_hook(
            lambda _m, args: seen.append((args[0].numel(), torch.get_num_threads()))
        )
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        small, large = list(range(10, 40)), [(7 * i) % 250 + 1 for i in range(100)]
        outs = engine.generate([small], params) + engine.generate([large], params)
        assert (30, 1) in seen and (100, 2) in seen, seen
        assert all(threads == (1 if n < 64 else 2) for n, threads in seen), seen
        plain = Engine(replace(config, one_thread_below=0))
        assert [o.token_ids for o in outs] == [
            o.token_ids for o in plain.generate([small], params) + plain.generate([large], params)
        ]
    finally:
        torch.set_num_threads(before)
