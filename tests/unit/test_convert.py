from __future__ import annotations

import dataclasses
import math

import pytest

from ferry.protos import common_pb2 as pb
from ferry.services.common import convert
from ferry.services.common.sampling_params import SamplingParams, StructuredOutput
from ferry.services.engine.model.full_size import DEEPSEEK_V4_FLASH as V4_FLASH
from ferry.services.engine.model.v4.kv_cache import v4_cache_spec
from ferry.services.engine.request import RequestOutput
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint
from ferry.services.worker import convert as worker_convert


def test_unset_fields_take_the_engine_defaults_and_unset_max_tokens_means_no_limit() -> None:
    params = convert.sampling_params_from_pb(pb.SamplingParams())
    default = SamplingParams(max_tokens=None)
    assert params == default and params.max_tokens is None


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("json_schema", '{"type": "object"}'),
        StructuredOutput("json_object"),
        StructuredOutput("regex", "[a-z]+"),
        StructuredOutput("choice", choices=("a", "b c")),
        StructuredOutput("grammar", 'root ::= "x"'),
    ],
)
def test_structured_output_round_trip(spec: StructuredOutput) -> None:
    p = SamplingParams(structured_output=spec, max_tokens=None)
    assert convert.sampling_params_from_pb(convert.sampling_params_to_pb(p)) == p
    with pytest.raises(ValueError, match="structured_output: set one of"):
        convert.sampling_params_from_pb(pb.SamplingParams(structured_output=pb.StructuredOutput()))


def test_sampling_params_round_trip() -> None:
    p = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.01,
        seed=11,
        max_tokens=33,
        stop=("\n",),
        stop_token_ids=(2,),
        min_tokens=3,
        logprobs=2,
        prompt_logprobs=0,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        ignore_eos=True,
        logit_bias={7: 2.5, 3: -100.0},
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        priority=-3,
    )
    assert convert.sampling_params_from_pb(convert.sampling_params_to_pb(p)) == p


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in 0..20"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias \(5, 101.0\): token ids are >= 0 and biases"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias \(-1, 1.0\)"),
        ({"logit_bias": {2: math.nan}}, r"logit_bias \(2, nan\)"),
    ],
)
def test_bad_values_name_the_field(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        convert.sampling_params_from_pb(pb.SamplingParams(**fields))  # type: ignore[arg-type]


def test_kv_handle_round_trip_and_empty_transfer_id() -> None:
    h = KvHandle(
        transfer_id="t-1",
        worker_id="prefill-0",
        host="127.0.0.1",
        port=4242,
        num_tokens=40,
        block_size=16,
        num_blocks=3,
        layout=LayoutFingerprint.latent("abc", "bfloat16", 4, 576, 16),
        expires_at=12.5,
        transport="ucx",
    )
    assert worker_convert.kv_handle_from_pb(worker_convert.kv_handle_to_pb(h)) == h
    assert KvHandle.from_json(h.to_json()) == h
    # DeepSeek-V4-Flash: three paged groups, and 11.2 MiB of rings in 14 blocks of 860 KiB
    spec = v4_cache_spec(V4_FLASH)
    v4 = dataclasses.replace(h, layout=LayoutFingerprint.of("v4", "bfloat16", 128, spec))
    assert v4.layout.state_blocks == 14 and len(v4.layout.state) == 4
    assert worker_convert.kv_handle_from_pb(worker_convert.kv_handle_to_pb(v4)) == v4
    assert KvHandle.from_json(v4.to_json()) == v4
    with pytest.raises(ValueError, match="transfer_id is empty"):
        worker_convert.kv_handle_from_pb(pb.KvHandle())


def test_logprobs_round_trip() -> None:
    lp = {3: -0.1, 9: -2.5}
    assert worker_convert.logprobs_from_pb(worker_convert.logprobs_to_pb(lp)) == pytest.approx(lp)
    assert worker_convert.logprobs_from_pb(worker_convert.logprobs_to_pb(None)) is None


def test_prompt_logprobs_go_with_the_requests_first_token_only() -> None:
    """The chunk with the first token carries them (a prefill or aggregated worker's); a decode
    worker's first chunk starts at the second token and does not."""
    lps = [{5: -0.5, 6: -1.0}, {7: -0.25}]

    def out(tokens: list[int], delta: list[int]) -> RequestOutput:
        return RequestOutput(
            "r", [1, 5, 7], tokens, "", None, None, 0, delta_token_ids=delta, prompt_logprobs=lps
        )

    first = worker_convert.chunk_from_outputs([out([9], [9]), out([9, 8], [8])])
    assert [worker_convert.logprobs_from_pb(lp) for lp in first.prompt_logprobs] == lps
    assert list(first.token_ids) == [9, 8]
    assert not worker_convert.chunk_from_outputs([out([9, 8], [8])]).prompt_logprobs
