"""The compiled pieces of the eager forward (piece_graphs.py) against the eager code: V4's
hyper-connection mixing at every token count, the routed experts of small batches, the same
greedy tokens and logprobs from an engine (prefill and decode), and nothing compiled where the
engine runs eagerly."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.fused_moe.reference import fused_moe_torch
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.model.mhc import HyperConnection
from ferry.services.engine.model.moe import MoE
from ferry.services.engine.piece_graphs import compile_pieces
from ferry.services.worker.config import WorkerConfig
from ferry.services.worker.prefill import PrefillWorker

MAX_BATCH = 4


@pytest.fixture(scope="module")
def compiled() -> Engine:
    """An eager engine given the pieces, as the engine gives them to the steps its decode
    graphs do not take (test_decode_graphs_v4.py has those)."""
    engine = Engine(EngineConfig(model="v4-tiny", num_kv_blocks=96, enforce_eager=True))
    assert compile_pieces(engine.model, MAX_BATCH) == 2
    return engine


def _hyper_connections(engine: Engine) -> list[HyperConnection]:
    return [m for m in engine.model.modules() if isinstance(m, HyperConnection)]


def test_every_hyper_connection_mixes_as_the_eager_code_at_any_token_count(
    compiled: Engine,
) -> None:
    hcs = _hyper_connections(compiled)
    assert len(hcs) == 2 * compiled.model.config.num_hidden_layers
    assert all(hc.compiled is hcs[0].compiled is not None for hc in hcs)  # one graph for all
    gen = torch.Generator().manual_seed(0)
    for layer, tokens in enumerate((1, 2, 5, 300, 2049)):
        hc = hcs[layer % len(hcs)]
        streams = torch.randn(tokens, hc.hc, hc.fn.shape[1] // hc.hc, generator=gen)
        want = hc.mix(streams, hc.fn, hc.base, hc.scale)
        got = hc(streams)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_small_batches_routed_experts_match_the_loop_over_experts(compiled: Engine) -> None:
    moes = [m for m in compiled.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.small_batch is not None for m in moes)
    moe = moes[-1]
    assert moe.small_batch is not None
    most, experts = moe.small_batch
    assert most == MAX_BATCH
    w13, w2 = moe.experts.w13, moe.experts.w2
    gen = torch.Generator().manual_seed(1)
    for tokens in (1, 2, MAX_BATCH):
        hidden = torch.randn(tokens, w13.shape[-1], generator=gen)
        weights = torch.rand(tokens, moe.config.num_experts_per_tok, generator=gen)
        slots = torch.randint(0, w13.shape[0], weights.shape, generator=gen)
        slots[0, 0] = slots[0, 1]  # an expert chosen twice counts twice
        want = fused_moe_torch(hidden, w13, w2, weights, slots, moe.swiglu_limit)
        got = experts(hidden, w13, w2, weights, slots)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_compiled_engine_gives_the_eager_tokens_and_logprobs(compiled: Engine) -> None:
    eager = Engine(EngineConfig(model="v4-tiny", num_kv_blocks=96, enforce_eager=True))
    assert all(hc.compiled is None for hc in _hyper_connections(eager))
    assert all(m.small_batch is None for m in eager.model.modules() if isinstance(m, MoE))
    # prompts of different lengths (chunks past the sliding window and the compression rates)
    # decoding together and finishing one by one: batches of 5 run the loop over experts, then
    # 4..1 the compiled experts
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 300, 129, 3)]
    params = [
        SamplingParams(temperature=0, max_tokens=8 * (i + 1), ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    moe = next(m for m in compiled.model.modules() if isinstance(m, MoE))
    assert moe.small_batch is not None
    most, experts = moe.small_batch
    calls = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        out: torch.Tensor = experts(*args)
        return out

    moe.small_batch = (most, counted)
    want = eager.generate(prompts, params)
    try:
        got = compiled.generate(prompts, params)
    finally:
        moe.small_batch = (most, experts)
    assert set(calls) >= {1, 2, 3, MAX_BATCH}  # decode batches (and the 3-token prompt)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        for lw, lg in zip(w.logprobs or [], g.logprobs or [], strict=True):
            assert lw.keys() == lg.keys()
            for token, value in lw.items():
                assert lg[token] == pytest.approx(value, abs=1e-4)
    compiled.check_integrity()
    assert compiled.kv.usage()["in_use"] == 0


def test_a_prefill_worker_compiles_its_pieces_and_no_decode_graph() -> None:
    """A prefill worker never decodes: no decode graphs, but its eager steps (V4's prefill)
    get the compiled pieces."""
    config = WorkerConfig(
        engine=EngineConfig(model="v4-tiny", num_kv_blocks=32, enforce_eager=False)
    )
    engine = PrefillWorker._engine(config)
    assert engine.graphs is None
    assert all(hc.compiled is not None for hc in _hyper_connections(engine))
    assert all(m.small_batch is not None for m in engine.model.modules() if isinstance(m, MoE))
