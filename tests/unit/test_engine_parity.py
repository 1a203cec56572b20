"""Engine greedy outputs against transformers' generate, token for token, and the prompt logprobs
against transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.helpers import YARN, Checkpoint, hf_greedy, hf_logits

PROMPT_LENS = [1, 5, 17, 64, 100, 177, 300, 500]
MAX_NEW = 24
# lm_head scaled x20: the top logit leads by a wide margin, so no near-tie can flip a token
CHECKPOINT = Checkpoint(
    seed=21,
    lm_head_scale=20.0,
    config={"q_lora_rank": 24, "rope_parameters": YARN, "n_group": 4, "topk_group": 2},
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(checkpoint, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def prompt_logprobs(checkpoint: Path, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob (after the first) from one transformers forward."""
    out = []
    for ids in prompts:
        lp = torch.log_softmax(hf_logits(checkpoint, ids).float(), dim=-1)
        out.append([float(lp[i, t]) for i, t in enumerate(ids[1:])])
    return out


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_num_batched_tokens": 48},  # chunked prefill: the 500-token prompt takes 11 steps
        {"num_kv_blocks": 48, "max_num_batched_tokens": 256},  # forces preemption
    ],
    ids=["default", "chunked-prefill", "preemption"],
)
def test_greedy_and_prompt_logprobs_match_transformers(
    checkpoint: Path,
    prompts: list[list[int]],
    expected: list[list[int]],
    prompt_logprobs: list[list[float]],
    overrides: dict[str, int],
) -> None:
    config = EngineConfig(model=str(checkpoint), block_size=16, **overrides)
    engine = Engine(config)
    outs = engine.generate(prompts, PARAMS)
    for n, out, want, want_lp in zip(PROMPT_LENS, outs, expected, prompt_logprobs, strict=True):
        assert out.token_ids == want, f"prompt of {n} tokens"
        assert out.finish_reason == "length"
        got = [next(iter(e.values())) for e in out.prompt_logprobs or []]
        assert len(got) == n - 1
        assert torch.allclose(torch.tensor(got), torch.tensor(want_lp), rtol=1e-4, atol=1e-4), n
    if "num_kv_blocks" in overrides:
        assert engine.num_preemptions > 0
    engine.check_integrity()
    assert engine.kv.usage()["in_use"] == 0
