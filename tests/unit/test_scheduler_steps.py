"""next_step: what the scheduler's request loop does after a failed worker call."""

from __future__ import annotations

import grpc
import pytest

from ferry.services.scheduler.service import Failure, Step, next_step

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
FULL = grpc.StatusCode.RESOURCE_EXHAUSTED
CANCELLED = grpc.StatusCode.CANCELLED
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def step(
    stage: str,
    code: grpc.StatusCode,
    *,
    attempt: int = 0,
    streamed: bool = False,
    kv_error: str = "",
    others_left: bool = True,
    can_fall_back: bool = True,
    can_move: bool = False,
) -> Step:
    failure = Failure(stage, "w", code, "why", attempt, streamed, kv_error)
    return next_step(
        failure,
        max_attempts=3,
        others_left=others_left,
        can_fall_back=can_fall_back,
        can_move=can_move,
    )


@pytest.mark.parametrize("stage", ["aggregated", "prefill", "decode"])
@pytest.mark.parametrize("code", [UNAVAILABLE, FULL])
def test_a_worker_that_is_down_or_full_before_streaming_is_retried_elsewhere(
    stage: str, code: grpc.StatusCode
) -> None:
    assert step(stage, code) is Step.RETRY
    assert step(stage, code, attempt=1) is Step.RETRY


def test_retries_end_at_the_last_attempt_or_the_last_worker() -> None:
    assert step("decode", UNAVAILABLE, attempt=2) is Step.FAIL
    assert step("prefill", FULL, others_left=False) is Step.FAIL


def test_no_aggregated_worker_taking_it_falls_back_to_prefill_then_decode() -> None:
    assert step("aggregated", FULL, others_left=False) is Step.FALL_BACK
    assert step("aggregated", UNAVAILABLE, attempt=2) is Step.FALL_BACK
    assert step("aggregated", FULL, others_left=False, can_fall_back=False) is Step.FAIL


def test_what_streamed_never_retries_or_falls_back() -> None:
    assert step("aggregated", UNAVAILABLE, streamed=True) is Step.FAIL
    assert step("decode", UNAVAILABLE, streamed=True) is Step.FAIL


def test_a_request_that_streamed_tokens_moves_when_its_worker_went_away() -> None:
    for code in (UNAVAILABLE, CANCELLED, grpc.StatusCode.ABORTED):
        assert step("decode", code, streamed=True, can_move=True) is Step.MIGRATE
    # a decode that failed before its first chunk, after the prefill's first token was sent
    assert step("decode", UNAVAILABLE, attempt=2, can_move=True) is Step.MIGRATE
    assert step("decode", INVALID, streamed=True, can_move=True) is Step.FAIL


def test_a_kv_pull_that_failed_on_the_exporter_is_not_retried() -> None:
    assert step("decode", UNAVAILABLE, kv_error="transport") is Step.FAIL
    assert step("decode", UNAVAILABLE, kv_error="transport", can_move=True) is Step.MIGRATE


def test_a_lease_that_is_gone_moves_the_request_to_a_new_prefill() -> None:
    # `make chaos`, a DEP rank stopped: its peer pulled the KV, failed, and the next decode
    # attempt found no lease; it ended FAILED_PRECONDITION though the request could go on
    gone = grpc.StatusCode.FAILED_PRECONDITION
    assert step("decode", gone, kv_error="not_found", can_move=True) is Step.MIGRATE
    assert step("decode", gone, kv_error="not_found") is Step.FAIL  # --migration-limit 0
    assert step("decode", gone, kv_error="layout_mismatch", can_move=True) is Step.FAIL


def test_bad_input_fails_at_once() -> None:
    for stage in ("aggregated", "prefill", "decode"):
        assert step(stage, INVALID) is Step.FAIL
