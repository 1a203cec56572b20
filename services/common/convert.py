"""Conversions between SamplingParams and the ferry.v1 messages, which the scheduler (to
validate a request before routing it) and the workers both need; the workers' own conversions
(outputs, KV handles) are in services/worker/convert.py. Bad values raise ValueError with a
message that names the field; servers answer INVALID_ARGUMENT with it.
"""

from __future__ import annotations

import math

from ferry.protos import common_pb2 as pb
from ferry.services.common.sampling_params import SamplingParams, StructuredOutput

# Trailing metadata of a Decode whose KV pull failed on the exporter's side: another decode
# worker could not pull it either, so the scheduler does not retry that Decode elsewhere.
KV_ERROR_KEY = "ferry-kv-error"

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("top_k", "seed", "logprobs", "prompt_logprobs", "max_tokens")


def sampling_params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults, except ``max_tokens``: unset means
    until the model's length limit."""
    kw: dict[str, object] = {}
    for name in _FLOAT_FIELDS:
        if msg.HasField(name):
            value = getattr(msg, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            kw[name] = value
    for name in _INT_FIELDS:
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    if not msg.HasField("max_tokens"):
        kw["max_tokens"] = None
    elif msg.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {msg.max_tokens}")
    if msg.HasField("skip_special_tokens"):
        kw["skip_special_tokens"] = msg.skip_special_tokens
    if msg.HasField("structured_output"):
        kw["structured_output"] = structured_output_from_pb(msg.structured_output)
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(msg.logit_bias.items()),
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        priority=msg.priority,
        **kw,  # type: ignore[arg-type]
    )


def sampling_params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        priority=p.priority,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
    )
    for name in ("seed", "logprobs", "prompt_logprobs", "max_tokens"):
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    if p.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_pb(p.structured_output))
    return msg


def structured_output_from_pb(msg: pb.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError(
            "structured_output: set one of json_schema, json_object, regex, choice, grammar"
        )
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.values))
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(msg, kind))


def structured_output_to_pb(s: StructuredOutput) -> pb.StructuredOutput:
    if s.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(values=s.choices))
    if s.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    msg = pb.StructuredOutput()
    setattr(msg, s.kind, s.spec)  # json_schema, regex, grammar: the text
    return msg
