"""A checkpoint without tokenizer.json whose vocabulary the byte-level tokenizer does not fit
serves token-id prompts only (vLLM's --skip-tokenizer-init): the same tokens as with a
tokenizer, empty text, and what needs text refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ferry.services.common.sampling_params import StructuredOutput
from ferry.services.common.tokenizer import HFTokenizer, NoTokenizer, write_byte_tokenizer_json
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from tests.helpers import Checkpoint

EOS = 1
PROMPTS = [[5, 6, 7], list(range(10, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
CHECKPOINT = Checkpoint(
    seed=3, lm_head_scale=20.0, config={"vocab_size": 200, "bos_token_id": 0, "eos_token_id": EOS}
)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), block_size=16, num_kv_blocks=64))


def test_token_id_prompts_give_the_tokens_a_tokenizer_would(
    engine: Engine, checkpoint: Path, tmp_path: Path
) -> None:
    with_tokenizer = shutil.copytree(checkpoint, tmp_path / "with-tokenizer")
    write_byte_tokenizer_json(with_tokenizer)
    reference = Engine(EngineConfig(model=str(with_tokenizer), block_size=16, num_kv_blocks=64))
    assert isinstance(engine.tokenizer, NoTokenizer)
    assert isinstance(reference.tokenizer, HFTokenizer)
    outs, wants = engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY)
    for out, want in zip(outs, wants, strict=True):
        assert out.token_ids == want.token_ids and out.logprobs == want.logprobs
        assert out.finish_reason == "length" and out.text == "" and want.text


def test_stop_token_ids_and_eos_still_end_a_request(engine: Engine) -> None:
    base = engine.generate(PROMPTS[:1], GREEDY)[0]
    stop = base.token_ids[3]
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop) + 1]
    # EOS (config.json's) forced as the first token
    eos = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, logit_bias={EOS: 100}))[0]
    assert eos.token_ids == [EOS] and eos.finish_reason == "stop" and eos.text == ""
    engine.check_integrity()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(stop=["ab"]), r"^stop strings need the model's tokenizer"),
        (
            SamplingParams(structured_output=StructuredOutput("regex", "[0-9]+")),
            r"^structured output \(regex\) needs the model's tokenizer",
        ),
    ],
    ids=["stop", "structured"],
)
def test_what_needs_text_is_refused(engine: Engine, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.validate(PROMPTS[0], params)
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPTS[:1], params)
    assert not engine.has_unfinished_requests()


def test_a_text_prompt_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json.*send the prompt as token ids"):
        engine.generate(["Hello"])
