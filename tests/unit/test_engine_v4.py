"""DeepSeek-V4 through its paged cache and the engine: a sequence that continues from its cache
(state slot and blocks) gives the logits of the whole sequence at once, whatever the chunking and
whatever else shares the step; the engine's greedy outputs are transformers' ``generate`` with
chunked prefill forced and with preemption forced; the block size follows the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.engine import Engine, EngineConfig
from ferry.services.engine.model import ForwardBatch, load_model, prompt_logits
from ferry.services.engine.request import ImportedKv
from tests.helpers import Checkpoint, greedy_generate, make_request, rel_err
from tests.helpers_v4 import v4_hf_logits, v4_hf_model

BLOCK = 16  # the tiny config's CSA and HCA rates (4, 8) divide it
CHECKPOINT = Checkpoint(seed=11, family="v4", lm_head_scale=8.0)


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    return v4_hf_model(checkpoint)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_chunks(
    model: Any, seqs: list[list[int]], chunkings: list[list[int]]
) -> list[torch.Tensor]:
    """Feed each sequence in its chunks, all sequences' next chunks in one step; return every
    position's logits per sequence."""
    blocks_each = [-(-len(s) // BLOCK) for s in seqs]
    cache = model.allocate_kv_cache(sum(blocks_each), BLOCK, len(seqs))
    tables, start = [], 0
    for n in blocks_each:
        tables.append(list(range(start, start + n)))
        start += n
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    pending = [list(c) for c in chunkings]
    with torch.inference_mode():
        while any(pending):
            live = [i for i, p in enumerate(pending) if p]
            lens = [pending[i].pop(0) for i in live]
            ids = [
                t for i, n in zip(live, lens, strict=True) for t in seqs[i][done[i] : done[i] + n]
            ]
            batch = ForwardBatch.build(
                lens,
                [done[i] for i in live],
                [tables[i] for i in live],
                BLOCK,
                "expanded",
                state_slots=live,
            )
            logits = model.compute_logits(model(torch.tensor(ids), batch, cache))
            row = 0
            for i, n in zip(live, lens, strict=True):
                out[i].append(logits[row : row + n])
                row += n
                done[i] += n
    return [torch.cat(o) for o in out]


def test_chunks_ending_anywhere_match_the_whole_sequence(checkpoint: Path, hf: Any) -> None:
    """Prefill in uneven chunks, then decode one token at a time, two sequences at different
    phases in the same steps; their compressor buffers are mid-window at every cut."""
    model = load_model(checkpoint)
    a, b = _prompt(47, 1), _prompt(41, 2)
    chunkings = [[7, 11, 15, 7] + [1] * 7, [1, 2, 3, 13, 5] + [1] * 17]
    for seq, logits in zip([a, b], _run_chunks(model, [a, b], chunkings), strict=True):
        err = rel_err(logits, v4_hf_logits(hf, seq))
        assert err < 1e-4, err
    # and one token at a time from the start
    (one,) = _run_chunks(model, [a[:30]], [[1] * 30])
    assert rel_err(one, v4_hf_logits(hf, a[:30])) < 1e-4


def test_prompt_logits_uses_the_cache_path(checkpoint: Path, hf: Any) -> None:
    model = load_model(checkpoint)
    ids = _prompt(53, 3)
    assert rel_err(prompt_logits(model, ids), v4_hf_logits(hf, ids)) < 1e-4


def _engine(checkpoint: Path, **kw: Any) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), **kw))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_engine_greedy_matches_generate(checkpoint: Path, hf: Any) -> None:
    """Continuous batching of prompts of several lengths, chunked prefill forced (16 tokens a
    step), against transformers' generate with its own cache."""
    prompts = [_prompt(n, 20 + n) for n in (5, 23, 38, 9)]
    want = greedy_generate(hf, prompts, 12)
    engine = _engine(checkpoint, max_num_batched_tokens=16)
    assert engine.block_size == BLOCK * 4  # the default (64) holds whole entries here
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    engine.check_integrity()


def test_v4_tiny_greedy_does_not_change_with_batch_composition() -> None:
    """The preset cluster tests compare against: its margins hold when prompts share steps."""
    prompts = [[(11 * i + 5 * k) % 250 + 1 for k in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = Engine(EngineConfig(model="v4-tiny")).generate(prompts, params)
    alone = Engine(EngineConfig(model="v4-tiny"))
    assert [o.token_ids for o in together] == [
        alone.generate([p], params)[0].token_ids for p in prompts
    ]


def test_engine_greedy_with_preemption_forced(checkpoint: Path, hf: Any) -> None:
    """A cache too small for every sequence at once: sequences are preempted and recomputed
    from their tokens (their state slots rebuilt), and the outputs do not change."""
    prompts = [_prompt(n, 40 + n) for n in (30, 33, 35)]
    want = greedy_generate(hf, prompts, 12)
    engine = _engine(checkpoint, block_size=BLOCK, num_kv_blocks=5)
    outs = engine.generate(prompts, GREEDY)
    assert engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    engine.check_integrity()


def test_prompt_logprobs_through_the_engine(checkpoint: Path, hf: Any) -> None:
    """Prompt logprobs of a prompt prefilled in chunks: transformers' over the whole prompt."""
    ids = _prompt(29, 5)
    engine = _engine(checkpoint, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    (out,) = engine.generate([ids], params)
    want = torch.log_softmax(v4_hf_logits(hf, ids), dim=-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - 1
    for i, entry in enumerate(out.prompt_logprobs):
        assert abs(entry[ids[i + 1]] - float(want[i, ids[i + 1]])) < 1e-4, i
    engine.check_integrity()


def test_a_block_size_that_splits_an_entry_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"block_size=20 does not hold whole compressed entries"):
        _engine(checkpoint, block_size=20)


LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


def _close(a: list[dict[int, float]] | None, b: list[dict[int, float]] | None) -> bool:
    assert a is not None and b is not None and len(a) == len(b)
    return all(
        x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-5
        for x, y in zip(a, b, strict=True)
    )


def test_a_prefix_hit_continues_from_the_snapshot_exactly(checkpoint: Path, hf: Any) -> None:
    """The same prompt again, the next turn of a chat (the prompt + the answer + more), and a
    shared 140-token prefix: each hit restores the state snapshotted at its last block (the
    prompt's last boundary; every 8 blocks) and gives the cold engine's logprobs and
    transformers' tokens."""
    first = _prompt(50, 60)
    system = _prompt(140, 61)
    warm = _engine(checkpoint, block_size=BLOCK)
    cold = _engine(checkpoint, block_size=BLOCK, enable_prefix_caching=False)
    (a,) = warm.generate([first], LOGPROBS)
    assert a.num_cached_tokens == 0
    turn = first + a.token_ids + _prompt(9, 62)
    cases = [
        (first, 48),  # its own snapshot, one block short of its last token
        (turn, 48),
        (system + _prompt(5, 63), 0),
        (system + _prompt(7, 64), 128),  # the 8-block snapshot the first one left
    ]
    for prompt, cached in cases:
        (out,) = warm.generate([prompt], LOGPROBS)
        assert out.num_cached_tokens == cached, (len(prompt), out.num_cached_tokens)
        (ref,) = cold.generate([prompt], LOGPROBS)
        assert out.token_ids == ref.token_ids == greedy_generate(hf, [prompt], 6)[0]
        assert _close(out.logprobs, ref.logprobs)
        warm.check_integrity()


def test_snapshots_are_reported_for_the_prefix_index(checkpoint: Path) -> None:
    """A worker follows its engine's snapshot events: kept under the hash of the block they
    end, dropped when the least recently used one is taken for another."""
    engine = _engine(checkpoint, block_size=BLOCK, max_num_seqs=1)
    engine.kv.record_events()
    a, b = _prompt(40, 80), _prompt(40, 81)
    engine.generate([a], GREEDY)
    (kept,) = engine.kv.take_snapshot_events()
    assert kept == (True, engine.kv.match_prefix(make_request("x", a))[1][-1])
    engine.generate([b], GREEDY)
    events = engine.kv.take_snapshot_events()
    assert events[0] == (False, kept[1]) and events[1][0] is True
    assert engine.kv.take_snapshot_events(snapshot=True) == [events[1]]


def test_blocks_without_their_snapshot_are_no_hit(checkpoint: Path) -> None:
    """One snapshot (max_num_seqs=1): a second prompt's takes it, so the first prompt, its
    blocks still cached, is computed again from the start; the second one hits."""
    a, b = _prompt(40, 70), _prompt(40, 71)
    engine = _engine(checkpoint, block_size=BLOCK, max_num_seqs=1)
    engine.generate([a], GREEDY)
    engine.generate([b], GREEDY)
    blocks, _ = engine.kv.match_prefix(make_request("x", a))
    assert blocks == [] and engine.kv.pool.hash_to_block  # blocks cached, no snapshot: no hit
    (b_again,) = engine.generate([b], GREEDY)
    assert b_again.num_cached_tokens == 32
    (a_again,) = engine.generate([a], GREEDY)
    assert a_again.num_cached_tokens == 0
    engine.check_integrity()


def _hand_over(prefill: Engine, decode: Engine, prompt: list[int], rid: str) -> list[int]:
    """One request prefilled on ``prefill``, its blocks and state copied as a KV transport
    moves them (the blocks' bytes, in the hold's order), decoded on ``decode``."""
    prefill.add_request(rid, prompt, GREEDY, hand_off=True)
    (first,) = [o for _ in range(64) for o in prefill.step() if o.kv_hold]
    k = prefill.kv.num_state_blocks  # the state slot's bytes, after the prompt's blocks
    assert len(first.kv_block_ids) == prefill.kv.blocks_needed(len(prompt)) + k
    key = f"import:{rid}"
    dst = decode.kv.hold_new(key, len(first.kv_block_ids))
    assert dst is not None
    src_t, dst_t = prefill.kv_cache.transfer, decode.kv_cache.transfer
    dst_t[:, dst] = src_t[:, first.kv_block_ids]
    prefill.kv.release_hold(first.kv_hold)
    decode.add_request(rid, prompt, GREEDY, imported=ImportedKv(key, first.token_ids[0]))
    out = [o for _ in range(64) for o in decode.step() if o.finished]
    return out[0].token_ids


def test_a_hand_off_carries_the_state_to_the_decode_engine(checkpoint: Path, hf: Any) -> None:
    """Prompts whose lengths leave every compressor mid-window (5, 23, 38, 47 tokens; the rates
    are 4 and 8) prefilled in chunks on one engine and decoded on another from the blocks and
    the packed state slot alone: transformers' tokens, and nothing left held on either side."""
    prefill = _engine(checkpoint, block_size=BLOCK, max_num_batched_tokens=16)
    decode = _engine(checkpoint, block_size=BLOCK)
    prompts = [_prompt(n, 90 + n) for n in (5, 23, 38, 47)]
    want = greedy_generate(hf, prompts, 12)
    got = [_hand_over(prefill, decode, p, f"r{i}") for i, p in enumerate(prompts)]
    assert got == want
    for engine in (prefill, decode):
        engine.check_integrity()
        assert not engine.kv.holds and len(engine.kv.free_slots) == engine.kv.num_state_slots
