"""hypothesis over the gateway's public gRPC API (``ferry.v1.Ferry``, protos/ferry.proto) of a
real cluster: requests with random field values (integers at their ranges, NaN and infinities,
odd Unicode, repeated fields as large as a message may be), and random bytes as the request of
each method (random, a valid request mutated, integers past their field's range). No call ends
INTERNAL, UNKNOWN or DATA_LOSS; every refusal is a client's status with a message a person can
act on; every answer reads as the method's reply. (The API has no enum field to fuzz.)"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferry.protos import common_pb2, ferry_pb2
from tests.cluster import Cluster
from tests.fuzz.support import Tally, budget
from tests.helpers import TINY_HF

GENERATE, LIST_MODELS = "/ferry.v1.Ferry/Generate", "/ferry.v1.Ferry/ListModels"
# cases of each kind: name in the tally -> (method, cases)
BUDGET = {
    "Generate (fields)": (GENERATE, 600),
    "Generate (bytes)": (GENERATE, 400),
    "ListModels (bytes)": (LIST_MODELS, 100),
}
# what a client's mistake may be answered with; anything else fails the case
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}
BROKEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
MAX_TOKENS = 4  # what a request that keeps to the ranges may cost: the tiny model on this CPU
CALL_TIMEOUT_S = 60  # no case takes this long: one that does has hung
VOCAB = TINY_HF["vocab_size"]

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
ODD = ["\x00", "\u202e", "\ufeff", "\u200b", "\U0010ffff", "e\u0301", "\U0001f6a2", "\uffff"]


def _ints(low: int, high: int, valid: tuple[int, int] = (0, 0)) -> st.SearchStrategy[int]:
    """At the type's ends and around 0, anywhere in them, or within the field's ``valid``
    range (so that cases get past the checks of the other fields too)."""
    return st.one_of(
        st.sampled_from([low, -1, 0, 1, high]), st.integers(low, high), st.integers(*valid)
    )


def _floats(valid: tuple[float, float]) -> st.SearchStrategy[float]:
    """NaN, the infinities, the smallest and largest doubles, any double, or within
    ``valid``."""
    edges = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]
    return st.one_of(st.sampled_from(edges), st.floats(), st.floats(*valid))


def _huge(element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """A repeated field of 10k or 50k copies: all of them in one request stay within the 4 MiB
    a message may have."""
    return st.tuples(element, st.sampled_from([10_000, 50_000])).map(lambda p: [p[0]] * p[1])


def _int32(valid: tuple[int, int] = (0, 0)) -> st.SearchStrategy[int]:
    return _ints(*INT32, valid=valid)


TEXT = st.one_of(st.text(max_size=24), st.lists(st.sampled_from(ODD), max_size=6).map("".join))
TOKEN_IDS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=12),
    st.lists(_int32(), max_size=6),
    _huge(st.integers(0, VOCAB - 1)),
)
STRUCTURED = st.one_of(
    st.builds(
        common_pb2.StructuredOutput, json_schema=st.one_of(TEXT, st.just('{"type": "object"}'))
    ),
    st.builds(common_pb2.StructuredOutput, json_object=st.booleans()),
    st.builds(common_pb2.StructuredOutput, regex=TEXT),
    st.builds(common_pb2.StructuredOutput, grammar=TEXT),
    st.builds(
        common_pb2.StructuredOutput,
        choice=st.builds(common_pb2.Choices, values=st.lists(TEXT, max_size=4)),
    ),
)
BIASES = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(width=32))
SAMPLING: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    # always set: unset, a request decodes to the context limit
    {"max_tokens": st.one_of(st.integers(1, MAX_TOKENS), st.sampled_from([0, -1, INT32[0]]))},
    optional={
        "temperature": _floats((0, 2)),
        "top_p": _floats((0, 1)),
        "top_k": _int32((-1, VOCAB)),
        "min_p": _floats((0, 1)),
        "presence_penalty": _floats((-2, 2)),
        "frequency_penalty": _floats((-2, 2)),
        "repetition_penalty": _floats((0, 2)),
        "seed": _ints(*INT64),
        "logprobs": _int32((0, 20)),
        "stop": st.one_of(st.lists(TEXT, max_size=4), _huge(st.text(max_size=4))),
        "stop_token_ids": st.one_of(st.lists(_int32(), max_size=4), _huge(_int32())),
        "min_tokens": _int32((0, MAX_TOKENS)),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "prompt_logprobs": _int32((0, 20)),
        "logit_bias": st.one_of(
            st.dictionaries(_int32((0, VOCAB - 1)), BIASES, max_size=4),
            st.integers(0, 2**20).map(lambda n: {t: 1.0 for t in range(n, n + 50_000)}),
        ),
        "include_stop_str_in_output": st.booleans(),
        "priority": _int32(),
        "structured_output": STRUCTURED,
    },
)


def _requests(model: str) -> st.SearchStrategy[ferry_pb2.TextGenerateRequest]:
    prompt = st.one_of(
        st.fixed_dictionaries({"prompt": TEXT}),
        st.fixed_dictionaries({"prompt_token_ids": TOKEN_IDS}),
        st.fixed_dictionaries({"prompt": TEXT, "prompt_token_ids": TOKEN_IDS}),
        st.just({}),
    )
    return st.builds(
        lambda fields, **kw: ferry_pb2.TextGenerateRequest(**fields, **kw),
        prompt,
        model=st.one_of(st.just(model), st.just(""), TEXT),
        sampling_params=SAMPLING.map(lambda fields: common_pb2.SamplingParams(**fields)),
        request_id=st.one_of(st.just(""), TEXT, st.just("r" * 50_000)),
    )


def _varint(n: int) -> bytes:
    n &= 2**64 - 1  # a negative number is its 64-bit two's complement, as protobuf writes it
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def _past_range() -> st.SearchStrategy[bytes]:
    """A TextGenerateRequest whose sampling_params' integer fields hold any 64-bit varint (an
    int32 field keeps the low 32 bits; a double or string field gets the wrong wire type).
    max_tokens comes last: past the range, its low bits stay within 1..MAX_TOKENS or not
    above 0, so that no case decodes to the context limit."""
    field = st.tuples(
        st.integers(1, 20).filter(lambda f: f != 12), st.integers(INT64[0], 2**64 - 1)
    )
    max_tokens = st.tuples(st.integers(-1, MAX_TOKENS), st.integers(0, 2**31)).map(
        lambda p: p[0] + (p[1] << 32)
    )

    def message(fields: list[tuple[int, int]], last: int, ids: list[int]) -> bytes:
        inner = b"".join(_varint(f << 3) + _varint(v) for f, v in fields)
        inner += _varint(12 << 3) + _varint(last)
        prompt = b"".join(_varint(3 << 3) + _varint(t) for t in ids)
        return prompt + _varint(4 << 3 | 2) + _varint(len(inner)) + inner

    ids = st.one_of(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
        st.lists(_ints(*INT64), max_size=4),
    )
    return st.builds(message, st.lists(field, max_size=8), max_tokens, ids)


def _raw(requests: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Random bytes, or a valid request with bytes changed, then cut, then bytes added."""
    valid = requests.map(lambda m: m.SerializeToString())
    mutated = st.builds(
        _mutated,
        valid,
        st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=4),
        st.none() | st.integers(0, 64),
        st.binary(max_size=8),
    )
    return st.one_of(st.binary(max_size=256), mutated)


def _mutated(data: bytes, edits: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    out = bytearray(data)
    for at, byte in edits:
        if out:
            out[at % len(out)] = byte
    return bytes(out[:cut] if cut is not None else out) + tail


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.grpc) as ch:
        yield ch


def _payloads(kind: str, model: str) -> st.SearchStrategy[bytes]:
    if kind == "Generate (fields)":
        return _requests(model).map(lambda m: m.SerializeToString())
    if kind == "Generate (bytes)":
        return st.one_of(_raw(_requests(model)), _past_range())
    return _raw(st.just(ferry_pb2.ListModelsRequest()))  # it has no field to set


@pytest.mark.parametrize("kind", list(BUDGET))
def test_no_internal_or_unknown_and_every_refusal_explained(
    channel: grpc.Channel, checkpoint: Path, tallies: dict[str, Tally], kind: str
) -> None:
    method, cases = BUDGET[kind]
    tally = tallies["grpc"]

    @given(payload=_payloads(kind, str(checkpoint)))
    @budget(cases)
    def one(payload: bytes) -> None:
        code, details, replies = _call(channel, method, payload)
        tally.count(kind, code.name)
        problem = _problem(method, code, details, replies)
        if problem is not None:
            tally.fail(kind, problem)
        assert problem is None, f"{method}: {code.name} {details!r}; request {payload[:300]!r}"

    one()


def _call(
    channel: grpc.Channel, method: str, payload: bytes
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """The call's status, its details and the replies (bytes: no serializer either way)."""
    replies: list[bytes] = []
    try:
        if method == GENERATE:
            replies.extend(channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S))
        else:
            replies.append(channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        return e.code(), e.details() or "", replies
    return grpc.StatusCode.OK, "", replies


def _problem(method: str, code: grpc.StatusCode, details: str, replies: list[bytes]) -> str | None:
    if code in BROKEN:
        return "internal_or_unknown"
    if code == grpc.StatusCode.OK:
        return None if _replies_read(method, replies) else "unreadable_reply"
    if code not in CLIENT_CODES:
        return "other_status"
    # grpc's own words for a failure in a handler ("Exception calling application: ...")
    if len(details) < 8 or details.startswith(("Exception", "Unexpected")):
        return "no_message"
    return None


def _replies_read(method: str, replies: list[bytes]) -> bool:
    try:
        if method == LIST_MODELS:
            return len(replies) == 1 and bool(
                ferry_pb2.ListModelsReply.FromString(replies[0]).models
            )
        chunks = [common_pb2.TokenChunk.FromString(r) for r in replies]
    except Exception:
        return False
    return bool(chunks) and bool(chunks[-1].finish_reason)
