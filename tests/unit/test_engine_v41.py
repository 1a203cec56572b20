"""DeepSeek-V4.1 through its paged cache and the engine, against DeepSeek's reference (the golden
cases' greedy tokens, math mode): continuous batching with chunked prefill forced, preemption
forced, prefix-cache hits that continue from a snapshot, a prefill handed to a decode engine by
its blocks and packed state slot alone, and ``prompt_logits`` on the cache path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.engine import Engine, EngineConfig
from ferry.services.engine.model import load_model, prompt_logits
from ferry.services.engine.request import ImportedKv
from tests.v41_golden import CASES, PROMPTS, case_dir, goldens

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _engine(case: str, **kw: Any) -> Engine:
    kw = {"num_kv_blocks": 48, "block_size": 16, "enforce_eager": True} | kw
    return Engine(EngineConfig(model=str(case_dir(case)), **kw))


def _prompts(case: str) -> list[list[int]]:
    return [goldens(case)[f"prompt{i}.input_ids"].tolist() for i in PROMPTS]


def _reference(case: str, prompt: int, n: int = 10) -> list[int]:
    """The reference's greedy continuation (what its decode steps were fed)."""
    return goldens(case)[f"prompt{prompt}.math.decode_tokens"][:n].tolist()


@pytest.mark.parametrize("case", CASES)
def test_greedy_through_the_engine_is_the_references(case: str) -> None:
    """The three prompts at once, 7 tokens of prefill a step (chunks ending at every remainder
    of ratio 2 and of the candidate blocks), then decoded together; an 18-token block (any even
    size holds whole entries). The MoE's compiled pieces on (``enforce_eager`` off)."""
    engine = _engine(case, block_size=18, max_num_batched_tokens=7, enforce_eager=False)
    outs = engine.generate(_prompts(case), GREEDY)
    assert [o.token_ids for o in outs] == [_reference(case, i) for i in PROMPTS]
    engine.check_integrity()


def test_prompt_logits_on_the_cache_path_are_the_references() -> None:
    g = goldens("compact-fp8")
    model = load_model(str(case_dir("compact-fp8")))
    logits = prompt_logits(model, g["prompt1.input_ids"].tolist())
    torch.testing.assert_close(logits, g["prompt1.math.prefill_logits"], rtol=0, atol=1e-4)


def test_greedy_with_preemption_forced() -> None:
    """A cache too small for every sequence at once: sequences are preempted and recomputed
    from their tokens (their state slots rebuilt), and the outputs do not change."""
    case = "mini-flash-fp8"
    engine = _engine(case, num_kv_blocks=7)
    outs = engine.generate(_prompts(case), GREEDY)
    assert engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == [_reference(case, i) for i in PROMPTS]
    engine.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_prefix_hit_continues_from_the_snapshot(kv_cache_dtype: str) -> None:
    """The same prompt again and the next turn of a chat: each hit restores the state
    snapshotted at a block boundary (written as the prefill's layers passed it, the window's
    rows packed under FP8) and gives the cold engine's tokens and logprobs."""
    case = "mini-flash-bf16"
    prompt = _prompts(case)[2]  # 101 tokens: six whole blocks
    warm = _engine(case, kv_cache_dtype=kv_cache_dtype)
    cold = _engine(case, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    (first,) = warm.generate([prompt], GREEDY)
    if kv_cache_dtype == "auto":
        assert first.token_ids == _reference(case, 2)
    for again in (prompt, prompt + first.token_ids + [7, 8, 9]):
        (out,) = warm.generate([again], GREEDY)
        assert out.num_cached_tokens >= 96
        (ref,) = cold.generate([again], GREEDY)
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs or [], ref.logprobs or [], strict=True):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
        warm.check_integrity()


def _hand_over(prefill: Engine, decode: Engine, prompt: list[int], rid: str) -> list[int]:
    """One request prefilled on ``prefill``, its blocks and state copied as a KV transport
    moves them, decoded on ``decode``."""
    prefill.add_request(rid, prompt, GREEDY, hand_off=True)
    (first,) = [o for _ in range(64) for o in prefill.step() if o.kv_hold]
    key = f"import:{rid}"
    dst = decode.kv.hold_new(key, len(first.kv_block_ids))
    assert dst is not None
    decode.kv_cache.transfer[:, dst] = prefill.kv_cache.transfer[:, first.kv_block_ids]
    prefill.kv.release_hold(first.kv_hold)
    decode.add_request(rid, prompt, GREEDY, imported=ImportedKv(key, first.token_ids[0]))
    out = [o for _ in range(64) for o in decode.step() if o.finished]
    return out[0].token_ids


def test_a_hand_off_carries_the_state_to_the_decode_engine() -> None:
    """Odd prompts (a ratio-2 source's open row, Engram's look-back and every window in the
    state slot) prefilled in chunks on one engine, decoded on another from the blocks and the
    packed state slot alone: the reference's tokens, nothing left held on either side."""
    case = "compact-fp8"
    prefill = _engine(case, max_num_batched_tokens=16)
    decode = _engine(case)
    got = [_hand_over(prefill, decode, p, f"r{i}") for i, p in enumerate(_prompts(case))]
    assert got == [_reference(case, i) for i in PROMPTS]
    for engine in (prefill, decode):
        engine.check_integrity()
        assert not engine.kv.holds and len(engine.kv.free_slots) == engine.kv.num_state_slots


def test_an_odd_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="use a multiple of 2"):
        _engine("compact-fp8", block_size=17)
