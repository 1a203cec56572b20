"""ModelRunner without the engine: how a plan becomes one batch, and a chunked prompt run through
``run`` giving the model's own logits."""

from __future__ import annotations

import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.engine.config import EngineConfig
from ferry.services.engine.model import prompt_logits
from ferry.services.engine.model_runner import ModelRunner, StepInputs
from ferry.services.engine.step_planner import StepPlan
from tests.helpers import make_request


def test_step_inputs_lay_out_a_plan() -> None:
    """A prompt's middle chunk (no row sampled), a prompt's last chunk (its last row sampled)
    and one that asks for prompt logprobs (a row per position whose next prompt token it
    lacks: not the prompt's last, which samples)."""
    middle = make_request("middle", list(range(10, 20)))
    middle.num_computed_tokens = 2
    last = make_request("last", list(range(30, 36)))
    last.num_computed_tokens = 4
    asked = make_request("asked", [7, 8, 9, 10], SamplingParams(prompt_logprobs=1))
    asked.prompt_logprobs = [{}]  # position 0's is known (as after a preemption)
    inputs = StepInputs.from_plan(StepPlan([middle, last, asked], [3, 2, 4]))
    assert inputs.input_ids == [12, 13, 14, 34, 35, 7, 8, 9, 10]
    assert inputs.sample_rows == [4, 8]
    assert inputs.sampling == [last, asked]
    assert inputs.prompt_rows == [(6, asked, 9), (7, asked, 10)]


def test_a_chunked_prompt_gives_the_models_logits() -> None:
    config = EngineConfig(model="tiny", block_size=16, num_kv_blocks=16, enforce_eager=True)
    runner = ModelRunner(config)
    prompt = list(range(40, 90))
    req = make_request("r", prompt)
    want = prompt_logits(runner.model, prompt)[-1]
    with torch.inference_mode():
        for chunk in (32, 18):
            assert runner.kv.allocate(req, chunk)
            logits, sampling, forward_s = runner.run(StepPlan([req], [chunk]))
    assert req.num_computed_tokens == len(prompt) and sampling == [req] and forward_s > 0
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    runner.kv.check_integrity([req])
