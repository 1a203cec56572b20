"""DeepSeek-V4's compiled decode step (``DeepseekV4ForCausalLM.decode_graph``, run by
decode_graphs.py) against the eager forward: the same logits and the same cache writes (window
rings, compressor rings, compressed entries) at every batch size and block-table width, on tokens
that close a compression window and tokens that do not; then an engine's greedy tokens and
logprobs, with the state snapshotted by graph steps restored by a later prefix hit."""

from __future__ import annotations

import pytest
import torch

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.model import ForwardBatch
from ferry.services.engine.model.v4.kv_cache import V4KVCache

MAX_GRAPH_BATCH = 3
BLOCK = 16  # v4-tiny's smallest block (its HCA rate): snapshots every 8 blocks = 128 tokens


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"model": "v4-tiny", "num_kv_blocks": 96, "block_size": BLOCK}
    return EngineConfig(**(base | kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def compiled() -> Engine:
    engine = Engine(_config(enforce_eager=False, max_graph_batch=MAX_GRAPH_BATCH))
    assert engine.graphs is not None
    return engine


def _state(cache: V4KVCache) -> dict[str, torch.Tensor]:
    """Every tensor a step may write: the paged blocks and each ring."""
    return {"blocks": cache.blocks.clone()} | {n: cache.tensors[n].clone() for n in cache.rings}


def _load(cache: V4KVCache, state: dict[str, torch.Tensor]) -> None:
    cache.blocks.copy_(state["blocks"])
    for n in cache.rings:
        cache.tensors[n].copy_(state[n])


def test_every_batch_and_width_gives_the_eager_logits_and_writes(compiled: Engine) -> None:
    """Random caches; positions that close a CSA window (every 4), an HCA one (every 16) or
    neither, and the first tokens of a sequence (no window closed yet). A graph specialised to
    one size, or a write through a copy of the cache, fails here."""
    graphs = compiled.graphs
    assert graphs is not None
    cache, model = compiled.kv_cache, compiled.model
    blocks = compiled.kv.num_blocks
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for batch in range(1, MAX_GRAPH_BATCH + 1):
            for width in (2, 3, 17, 40):
                cache.flat.copy_(torch.randn(cache.flat.shape, generator=gen) * 0.5)
                for n in cache.rings:
                    t = cache.tensors[n]
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
                tables = [[(7 * i + j) % blocks for j in range(width)] for i in range(batch)]
                top = width * BLOCK - 1  # closes both windows
                positions = [top, top - 4, top - 6][:batch] if width < 40 else [1, 2, 15][:batch]
                ids = [11 + i for i in range(batch)]
                slots = [2 * i + 1 for i in range(batch)]
                before = _state(cache)
                counts = torch.zeros(len(graphs._counts_example()), dtype=torch.long)
                logits = graphs.run(ids, positions, tables, counts, slots)
                written = _state(cache)
                _load(cache, before)
                fb = ForwardBatch.build(
                    [1] * batch, positions, tables, BLOCK, "expanded", "cpu", slots
                )
                want = model.compute_logits(model(torch.tensor(ids), fb, cache))
                torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
                for name, tensor in _state(cache).items():
                    got = written[name]
                    if name == "blocks":  # the entries, as the model's dtype
                        got, tensor = got.view(torch.float32), tensor.view(torch.float32)
                    torch.testing.assert_close(got, tensor, rtol=1e-4, atol=1e-5, msg=name)
                learned = sum(not m.hashed for m in model.moe_layers())  # type: ignore[attr-defined]
                assert counts.sum() == learned * batch * model.config.num_experts_per_tok
    cache.blocks.zero_()
    for n in cache.rings:
        cache.tensors[n].zero_()


def test_an_engine_gives_the_eager_tokens_and_restores_what_graph_steps_saved(
    compiled: Engine,
) -> None:
    """Five requests joining and leaving a running batch (4 and 5 at once: past the graphs,
    eager); decode steps cross the 128-token snapshot point, and a later prompt that extends
    one of them hits it."""
    eager = Engine(_config(enforce_eager=True))
    assert eager.graphs is None

    def run(engine: Engine) -> list[tuple[list[int], list[dict[int, float]], int]]:
        out = {}
        for i, n in enumerate((5, 70, 120, 100, 9)):
            params = SamplingParams(
                temperature=0, max_tokens=30 + 5 * i, ignore_eos=True, logprobs=2
            )
            engine.add_request(f"r{i}", [3 + (7 * j + i) % 300 for j in range(n)], params)
            engine.step()
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = o
        first = out["r2"]  # 120 + 40 tokens: its decode crossed 128
        turn = [3 + (7 * j + 2) % 300 for j in range(120)] + first.token_ids + [5, 6, 7]
        (hit,) = engine.generate([turn], SamplingParams(temperature=0, max_tokens=8, logprobs=2))
        done = [*(out[f"r{i}"] for i in range(5)), hit]
        return [(o.token_ids, o.logprobs or [], o.num_cached_tokens) for o in done]

    steps = compiled.graphs.steps if compiled.graphs else 0
    load = compiled.expert_load.window()
    want, got = run(eager), run(compiled)
    assert compiled.graphs is not None and compiled.graphs.steps > steps
    assert got[-1][2] == want[-1][2] == 128  # the snapshot a graph step took
    # learned layers counted in the graph, hash-routed ones from the tokens: as eagerly
    assert torch.equal(compiled.expert_load.window() - load, eager.expert_load.window())
    for (tokens, logprobs, _), (w_tokens, w_logprobs, _) in zip(got, want, strict=True):
        assert tokens == w_tokens
        for mine, theirs in zip(logprobs, w_logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token, lp in theirs.items():
                assert mine[token] == pytest.approx(lp, abs=1e-4)
    compiled.check_integrity()
    assert compiled.kv.usage()["in_use"] == 0
