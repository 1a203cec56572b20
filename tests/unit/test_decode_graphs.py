"""The compiled decode path (decode_graphs.py) against the eager engine: the same greedy tokens
and logprobs, batches that change and contexts that grow past every block-table width without a
recompile, and the steps it does not take (prefill chunks, batches past ``max_graph_batch``)."""

from __future__ import annotations

import pytest
import torch

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.decode_graphs import DecodeGraphs
from ferry.services.engine.model import ForwardBatch

MAX_GRAPH_BATCH = 3


@pytest.fixture(scope="module")
def compiled() -> Engine:
    config = EngineConfig(
        model="tiny", num_kv_blocks=80, enforce_eager=False, max_graph_batch=MAX_GRAPH_BATCH
    )
    engine = Engine(config)
    assert engine.graphs is not None
    return engine


def _run(engine: Engine) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    """Five requests of different lengths that start and finish at different steps, so the
    batch runs through 1..5 sequences (4 and 5: past MAX_GRAPH_BATCH, eager)."""
    out: dict[str, tuple[list[int], list[dict[int, float]]]] = {}
    for i, n in enumerate((5, 70, 300, 129, 64)):
        params = SamplingParams(temperature=0, max_tokens=20 + 15 * i, ignore_eos=True, logprobs=2)
        engine.add_request(f"r{i}", list(range(3, 3 + n)), params)
        engine.step()  # requests join a running batch one by one
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = (o.token_ids, o.logprobs or [])
    return out


def test_compiled_decode_gives_the_eager_tokens_and_logprobs(compiled: Engine) -> None:
    eager = Engine(EngineConfig(model="tiny", num_kv_blocks=80, enforce_eager=True))
    assert eager.graphs is None
    steps_before = compiled.graphs.steps if compiled.graphs else 0
    load_before = compiled.expert_load.window()
    want, got = _run(eager), _run(compiled)
    assert compiled.graphs is not None and compiled.graphs.steps > steps_before
    # the graph's MoE choices are counted as the eager forward counts them
    assert torch.equal(compiled.expert_load.window() - load_before, eager.expert_load.window())
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for mine, theirs in zip(got[rid][1], logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token, lp in theirs.items():
                assert mine[token] == pytest.approx(lp, abs=1e-4), rid
    compiled.check_integrity()
    assert compiled.kv.usage()["in_use"] == 0


def test_every_batch_and_width_runs_without_recompiling(compiled: Engine) -> None:
    """Each batch size the graphs cover, block tables from 2 blocks to the longest context:
    the logits and the cache writes match the eager forward's. A graph specialised to one size
    (inductor folds equal sizes together) fails here."""
    graphs = compiled.graphs
    assert graphs is not None
    bs = compiled.block_size
    blocks = compiled.kv.num_blocks
    widths = (2, 3, 17, graphs.max_width)
    with torch.inference_mode():
        for batch in range(1, MAX_GRAPH_BATCH + 1):
            for width in widths:
                tables = [[(7 * i + j) % blocks for j in range(width)] for i in range(batch)]
                positions = [width * bs - 1 - 5 * i for i in range(batch)]
                ids = [11 + i for i in range(batch)]
                before = compiled.kv_cache.clone()
                counts = torch.zeros(len(graphs._counts_example()), dtype=torch.long)
                logits = graphs.run(ids, positions, tables, counts)
                written = compiled.kv_cache.clone()
                compiled.kv_cache.copy_(before)
                fb = ForwardBatch.build([1] * batch, positions, tables, bs)
                hidden = compiled.model(torch.tensor(ids), fb, compiled.kv_cache)
                want = compiled.model.compute_logits(hidden)
                torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(written, compiled.kv_cache, rtol=1e-4, atol=1e-5)
                moe_layers = compiled.model.config.num_moe_layers
                assert counts.sum() == moe_layers * batch * 4  # every choice, counted once
                compiled.kv_cache.zero_()


def test_a_graph_for_batch_two_only_takes_every_width() -> None:
    """``--max-num-seqs 2``: the batched graph is for batch 2 alone; an example block table of
    width 2 would share the batch's symbol and pin the width (a context past two blocks then
    failed inside the compiled step)."""
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=40, enforce_eager=True))
    bs = engine.block_size
    graphs = DecodeGraphs(engine.model, engine.kv_cache, bs, 40 * bs, 2, plan=[(2, 2, {})])
    with torch.inference_mode():
        for width in (2, 3, 5):
            tables = [[2 * width * i + j for j in range(width)] for i in range(2)]
            positions = [width * bs - 1, width * bs - 3]
            counts = torch.zeros(len(graphs._counts_example()), dtype=torch.long)
            logits = graphs.run([11, 12], positions, tables, counts)
            engine.kv_cache.zero_()
            fb = ForwardBatch.build([1, 1], positions, tables, bs)
            want = engine.model.compute_logits(
                engine.model(torch.tensor([11, 12]), fb, engine.kv_cache)
            )
            engine.kv_cache.zero_()
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_a_batch_of_short_and_long_contexts_gives_the_eager_logits(compiled: Engine) -> None:
    """The batched graph attends each sequence over its own context (a short one beside the
    longest table is not padded to it: ``ferry::mla_decode_paged`` groups by length)."""
    graphs = compiled.graphs
    assert graphs is not None
    bs, blocks = compiled.block_size, compiled.kv.num_blocks
    positions = [3, graphs.max_width * bs - 1, 40][:MAX_GRAPH_BATCH]
    tables = [[(11 * i + j) % blocks for j in range(p // bs + 1)] for i, p in enumerate(positions)]
    ids = [21 + i for i in range(len(positions))]
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        compiled.kv_cache.copy_(torch.randn(compiled.kv_cache.shape, generator=gen) * 0.5)
        before = compiled.kv_cache.clone()
        counts = torch.zeros(len(graphs._counts_example()), dtype=torch.long)
        logits = graphs.run(ids, positions, tables, counts)
        compiled.kv_cache.copy_(before)
        fb = ForwardBatch.build([1] * len(ids), positions, tables, bs)
        want = compiled.model.compute_logits(
            compiled.model(torch.tensor(ids), fb, compiled.kv_cache)
        )
        compiled.kv_cache.zero_()
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_prefill_steps_and_large_batches_run_eagerly(compiled: Engine) -> None:
    graphs = compiled.graphs
    assert graphs is not None
    assert not graphs.covers(MAX_GRAPH_BATCH + 1)
    before = graphs.steps
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    compiled.generate([list(range(3, 40))], params)  # one prefill step, no decode
    assert graphs.steps == before
