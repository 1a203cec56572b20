"""Engine greedy outputs against transformers' generate, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import Engine, EngineConfig, SamplingParams
from tests.helpers import YARN, hf_greedy, make_hf_checkpoint

PROMPT_LENS = [1, 5, 17, 64, 100, 177, 300, 500]
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # lm_head scaled x20: the top logit leads by a wide margin, so no near-tie can flip a token
    return make_hf_checkpoint(
        tmp_path_factory.mktemp("engine"), seed=21, lm_head_scale=20.0, q_lora_rank=24,
        rope_parameters=YARN, n_group=4, topk_group=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(checkpoint, prompts, MAX_NEW)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_num_batched_tokens": 48},  # chunked prefill: the 500-token prompt takes 11 steps
        {"num_kv_blocks": 48, "max_num_batched_tokens": 256},  # forces preemption
    ],
    ids=["default", "chunked-prefill", "preemption"],
)
def test_greedy_matches_transformers(
    checkpoint: Path, prompts: list[list[int]], expected: list[list[int]], overrides: dict[str, int]
) -> None:
    config = EngineConfig(model=str(checkpoint), block_size=16, **overrides)
    engine = Engine(config)
    outs = engine.generate(prompts, PARAMS)
    for n, out, want in zip(PROMPT_LENS, outs, expected, strict=True):
        assert out.token_ids == want, f"prompt of {n} tokens"
        assert out.finish_reason == "length"
    if "num_kv_blocks" in overrides:
        assert engine.num_preemptions > 0
    engine.check_integrity()
    assert engine.kv.usage()["in_use"] == 0
