"""DeepSeek-V4.1 in Ferry's model runtime against DeepSeek's reference (the golden cases, math
mode: float32, quantisation points as identity): prefill logits within 1e-4 at every position of
every prompt, the index sets, candidate blocks and routed experts equal; token-by-token decode
within 1e-4 of the reference's and equal to Ferry's own prefill of the same tokens; and a
prefill in chunks of every size up to past the candidate block giving the one-chunk logits."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.loader import load_checkpoint
from ferry.services.engine.model.registry import config_from_hf_dict
from ferry.services.engine.model.v41.config import V41ModelConfig
from ferry.services.engine.model.v41.layers import SequenceState, Trace
from ferry.services.engine.model.v41.model import DeepseekV41ForCausalLM
from tests.v41_golden import CASES, PROMPTS, case_dir, case_json, config_json, goldens

ATOL = 1e-4  # the golden README's math-mode tolerance: 20x the observed noise


@functools.cache
def model(case: str) -> DeepseekV41ForCausalLM:
    loaded = load_checkpoint(case_dir(case))
    assert isinstance(loaded, DeepseekV41ForCausalLM)
    return loaded


def run(case: str, ids: torch.Tensor, state: SequenceState, trace: Trace | None = None):
    m = model(case)
    with torch.inference_mode():
        return m.compute_logits(m.forward_chunk(ids, state, trace))


def same(mine: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(mine.to(want.dtype), want)


@pytest.mark.parametrize("case", CASES)
def test_both_config_forms_read_alike_and_give_the_cases_layer_roles(case: str) -> None:
    hf = config_from_hf_dict(config_json(case), case)
    flat = config_from_hf_dict(case_json(case)["model_args_faithful"], case)
    assert isinstance(hf, V41ModelConfig) and isinstance(flat, V41ModelConfig)
    metadata = {"max_position_embeddings", "image_token_id", "bos_token_id", "eos_token_ids"}
    differ = {
        f.name
        for f in dataclasses.fields(hf)
        if getattr(hf, f.name) != getattr(flat, f.name) and f.compare
    }
    assert differ <= metadata
    roles = case_json(case)["layer_roles"]
    assert hf.layer_roles() == roles[: hf.num_hidden_layers]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_gives_the_references_logits_and_choices(case: str, prompt: int) -> None:
    g = goldens(case)
    p = f"prompt{prompt}.math"
    trace = Trace()
    logits = run(case, g[f"prompt{prompt}.input_ids"], SequenceState(), trace)
    torch.testing.assert_close(logits, g[f"{p}.prefill_logits"], rtol=0, atol=ATOL)
    c = model(case).config
    assert sorted(trace.topk) == list(c.index_source_layer_ids)
    for layer, chosen in trace.topk.items():
        assert same(chosen, g[f"{p}.topk.layer{layer}"]), f"index set of layer {layer}"
    (layer, mask), *_ = trace.candidates.items()
    assert layer == c.candidate_source_layer_id
    assert same(mask[-1], g[f"{p}.candidates.layer{layer}"])
    for layer, experts in trace.experts.items():
        assert same(experts, g[f"{p}.experts.layer{layer}"]), f"experts of layer {layer}"
    if prompt == 0:  # the residual streams after every block
        for layer, streams in trace.block_out.items():
            want = g[f"{p}.block_out.layer{layer}"]
            torch.testing.assert_close(streams, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_decode_gives_the_references_logits_and_its_own_prefills(case: str, prompt: int) -> None:
    """Token by token after the prompt, fed the reference's greedy tokens: its logits and index
    sets, greedy tokens that are the ones fed next, and the logits a prefill of the whole
    sequence gives at those positions (the goldens' index-key fix: see the README)."""
    g = goldens(case)
    p = f"prompt{prompt}.math"
    prompt_ids, fed = g[f"prompt{prompt}.input_ids"], g[f"{p}.decode_tokens"]
    state = SequenceState()
    run(case, prompt_ids, state)
    steps = []
    for k in range(len(fed)):
        trace = Trace()
        steps.append(run(case, fed[k : k + 1], state, trace)[0])
        for layer, chosen in trace.topk.items():
            assert same(chosen[0], g[f"{p}.decode_topk.layer{layer}"][k]), (k, layer)
    decode = torch.stack(steps)
    torch.testing.assert_close(decode, g[f"{p}.decode_logits"], rtol=0, atol=ATOL)
    assert same(decode.argmax(-1), g[f"{p}.decode_argmax"])
    assert torch.equal(decode.argmax(-1)[:-1], fed[1:])
    whole = run(case, torch.cat([prompt_ids, fed]), SequenceState())[len(prompt_ids) :]
    torch.testing.assert_close(decode, whole, rtol=0, atol=1e-5)
    unfixed = g[f"prompt{prompt}.math_unfixed.decode_logits"]
    assert (decode - unfixed).abs().max() > 100 * ATOL  # the fix is in (see the README)


@pytest.mark.parametrize("case", CASES)
def test_a_prefill_in_chunks_gives_the_one_chunk_logits(case: str) -> None:
    """Chunks of 1, 2, 3 and around the candidate block's size: chunks end at both remainders
    of ratio 2 and at every remainder of the block (ratio 2's open row and the newest, partly
    filled block carry over)."""
    g = goldens(case)
    ids, want = g["prompt0.input_ids"], g["prompt0.math.prefill_logits"]
    block = model(case).config.candidate_block_size
    for size in sorted({1, 2, 3, block - 1, block, block + 1}):
        state = SequenceState()
        parts = [run(case, ids[s : s + size], state) for s in range(0, len(ids), size)]
        torch.testing.assert_close(torch.cat(parts), want, rtol=0, atol=ATOL, msg=str(size))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_source_layer_ids": [6]}, "layer 2 has ratio 2 but no kv_source_layer_ids entry"),
        ({"kv_source_layer_ids": [2, 4]}, "layer 6 (ratio 1) would read kv source 4, whose ratio"),
        ({"index_source_layer_ids": [4, 6, 8, 10]}, "layer 2 has ratio 2 but no index_source"),
        ({"candidate_topk_blocks": 4}, "(candidate_topk_blocks - 1) x candidate_block_size = 12"),
        ({"candidate_source_layer_id": 7}, "candidate_source_layer_id 7 is not an index source"),
        ({"compress_ratios": [0, 0, 2]}, "compress_ratios has 3 entries; expected"),
        ({"compress_ratios": [0, 0, 4] + [2] * 12}, "compress_ratios holds 4"),
        ({"index_topk": None}, "text_config.index_topk is missing"),
    ],
)
def test_a_config_that_cannot_run_names_the_file_and_the_field(
    change: dict[str, object], message: str
) -> None:
    d = config_json("mini-flash-fp8")
    d["text_config"] = {**d["text_config"], **change}
    if change.get("index_topk", 0) is None:
        del d["text_config"]["index_topk"]
    with pytest.raises(ConfigError, match="^cfg.json: .*" + re.escape(message)):
        config_from_hf_dict(d, "cfg.json")


@pytest.mark.parametrize("case", CASES)
def test_three_sequences_in_one_step_give_each_ones_logits(case: str) -> None:
    """The three prompts as one step (projections, mHC and MoE over all their tokens, each
    sequence's attention and choices on its own history), then their decode steps together:
    every logit the reference's."""
    g, m = goldens(case), model(case)
    prompts = [g[f"prompt{p}.input_ids"] for p in PROMPTS]
    states = [SequenceState() for _ in PROMPTS]
    traces = [Trace() for _ in PROMPTS]
    with torch.inference_mode():
        hidden = m.forward_sequences(list(zip(prompts, states, strict=True)), traces)
        logits = m.compute_logits(hidden).split([len(p) for p in prompts])
    for p, trace in zip(PROMPTS, traces, strict=True):
        want = g[f"prompt{p}.math.prefill_logits"]
        torch.testing.assert_close(logits[p], want, rtol=0, atol=ATOL)
        for layer, chosen in trace.topk.items():
            assert same(chosen, g[f"prompt{p}.math.topk.layer{layer}"]), (p, layer)
        for layer, experts in trace.experts.items():
            assert same(experts, g[f"prompt{p}.math.experts.layer{layer}"]), (p, layer)
    fed = torch.stack([g[f"prompt{p}.math.decode_tokens"] for p in PROMPTS])  # [3, N]
    with torch.inference_mode():
        steps = [
            m.compute_logits(m.forward_sequences(list(zip(fed[:, k : k + 1], states, strict=True))))
            for k in range(fed.shape[1])
        ]
    decode = torch.stack(steps, dim=1)  # [3, N, V]
    for p in PROMPTS:
        torch.testing.assert_close(decode[p], g[f"prompt{p}.math.decode_logits"], rtol=0, atol=ATOL)
