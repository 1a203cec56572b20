"""Conversions between the engine's and kv_transfer's Python types and the ferry.v1 messages.

Every service converts here, so a field added to a message is mapped in one place. Bad values
raise ValueError with a message that names the field; servers answer INVALID_ARGUMENT with it.
"""

from __future__ import annotations

import math

from ferry.protos import common_pb2 as pb
from ferry.protos import decode_worker_pb2, prefill_worker_pb2
from ferry.services.engine.request import RequestOutput, Resumed
from ferry.services.engine.sampling_params import SamplingParams, StructuredOutput
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint

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


def logprobs_to_pb(lp: dict[int, float] | None) -> pb.TokenLogprobs:
    entries = [] if lp is None else [pb.Logprob(token_id=t, logprob=v) for t, v in lp.items()]
    return pb.TokenLogprobs(entries=entries)


def resumed_of(
    request: prefill_worker_pb2.PrefillRequest | decode_worker_pb2.DecodeRequest,
) -> Resumed | None:
    """Where a request that moved here mid-stream resumes (None: it starts here)."""
    if not request.HasField("resumed"):
        return None
    return Resumed(request.resumed.num_output_tokens, request.resumed.num_emitted_chars)


def logprobs_from_pb(msg: pb.TokenLogprobs) -> dict[int, float] | None:
    return {e.token_id: e.logprob for e in msg.entries} or None


def chunk_from_outputs(outs: list[RequestOutput]) -> pb.TokenChunk:
    """One TokenChunk for consecutive outputs of one request (the reader lagged behind them).
    The chunk with the request's first token carries its prompt logprobs, when asked for (a
    decode worker's first chunk does not: the prefill worker sent the first token)."""
    last = outs[-1]
    chunk = pb.TokenChunk(request_id=last.request_id, finish_reason=last.finish_reason or "")
    first = outs[0]
    if first.prompt_logprobs and len(first.token_ids) == len(first.delta_token_ids):
        chunk.prompt_logprobs.extend(logprobs_to_pb(lp) for lp in first.prompt_logprobs)
    for out in outs:
        chunk.token_ids.extend(out.delta_token_ids)
        chunk.text += out.delta_text
    if last.logprobs is not None:
        n = len(chunk.token_ids)
        chunk.logprobs.extend(logprobs_to_pb(lp) for lp in last.logprobs[len(last.logprobs) - n :])
    if last.stop_reason is not None:
        chunk.stop_reason = str(last.stop_reason)
    if last.finish_reason is not None:
        chunk.usage.CopyFrom(usage_of(last))
    return chunk


def usage_of(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens,
    )


def kv_handle_to_pb(h: KvHandle) -> pb.KvHandle:
    lay = h.layout
    return pb.KvHandle(
        transfer_id=h.transfer_id,
        worker_id=h.worker_id,
        host=h.host,
        port=h.port,
        num_tokens=h.num_tokens,
        block_size=h.block_size,
        num_blocks=h.num_blocks,
        expires_at=h.expires_at,
        transport=h.transport,
        layout=pb.LayoutFingerprint(
            model_fingerprint=lay.model_fingerprint,
            dtype=lay.dtype,
            num_layers=lay.num_layers,
            latent_dim=lay.latent_dim,
            block_size=lay.block_size,
        ),
    )


def kv_handle_from_pb(msg: pb.KvHandle) -> KvHandle:
    if not msg.transfer_id:
        raise ValueError("kv_handle.transfer_id is empty")
    lay = msg.layout
    layout = LayoutFingerprint(
        lay.model_fingerprint, lay.dtype, lay.num_layers, lay.latent_dim, lay.block_size
    )
    return KvHandle(
        transfer_id=msg.transfer_id,
        worker_id=msg.worker_id,
        host=msg.host,
        port=msg.port,
        num_tokens=msg.num_tokens,
        block_size=msg.block_size,
        num_blocks=msg.num_blocks,
        layout=layout,
        expires_at=msg.expires_at,
        transport=msg.transport,
    )
