"""Conversions between the engine's outputs and the KV handles, and the ferry.v1 messages, for
the workers (sampling parameters: services/common/convert.py)."""

from __future__ import annotations

import dataclasses

from ferry.protos import common_pb2 as pb
from ferry.protos import decode_worker_pb2, prefill_worker_pb2
from ferry.services.engine.model.cache_spec import PagedGroup, StateRing
from ferry.services.engine.request import RequestOutput, Resumed
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint


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
            block_size=lay.block_size,
            groups=[pb.PagedGroup(**dataclasses.asdict(g)) for g in lay.groups],
            state=[pb.StateRing(**dataclasses.asdict(r)) for r in lay.state],
            state_blocks=lay.state_blocks,
        ),
    )


def kv_handle_from_pb(msg: pb.KvHandle) -> KvHandle:
    if not msg.transfer_id:
        raise ValueError("kv_handle.transfer_id is empty")
    lay = msg.layout
    layout = LayoutFingerprint(
        lay.model_fingerprint,
        lay.dtype,
        lay.block_size,
        tuple(
            PagedGroup(g.name, g.num_layers, g.tokens_per_entry, g.dim, g.packed)
            for g in lay.groups
        ),
        tuple(
            StateRing(r.name, r.num_layers, r.rows, r.dim, r.at_boundary, r.token_ids, r.packed)
            for r in lay.state
        ),
        lay.state_blocks,
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
