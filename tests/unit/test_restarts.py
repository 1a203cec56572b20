"""The restart policy of `ferry up`: which exits restart, the back-off, and when it gives up."""

from __future__ import annotations

import signal

import pytest

from ferry.infra.cli import build_parser
from ferry.infra.restarts import Backoff, RestartPolicy


@pytest.mark.parametrize(
    ("mode", "restarts"),
    [
        ("on-failure", {0: False, 1: True, 2: False, -signal.SIGKILL: True, -signal.SIGSEGV: True}),
        ("always", {0: True, 1: True, 2: False, -signal.SIGKILL: True}),
        ("never", {0: False, 1: False, 2: False, -signal.SIGKILL: False}),
    ],
)
def test_which_exits_restart(mode: str, restarts: dict[int, bool]) -> None:
    policy = RestartPolicy(mode)
    assert {code: policy.wants(code) for code in restarts} == restarts


def test_quick_failures_back_off_exponentially_then_give_up() -> None:
    backoff = Backoff(RestartPolicy(max_quick_failures=5))
    assert [backoff.after_exit(ran_s=2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, None]


def test_a_unit_that_ran_a_while_starts_its_back_off_over() -> None:
    backoff = Backoff(RestartPolicy(max_quick_failures=3, stable_s=60.0))
    assert [backoff.after_exit(5.0), backoff.after_exit(5.0)] == [1.0, 2.0]
    assert backoff.after_exit(600.0) == 1.0  # up ten minutes: not a crash loop
    assert [backoff.after_exit(5.0), backoff.after_exit(5.0), backoff.after_exit(5.0)] == [
        1.0,
        2.0,
        None,
    ]


def test_the_delay_is_capped() -> None:
    policy = RestartPolicy(first_delay_s=1.0, max_delay_s=10.0, max_quick_failures=100)
    backoff = Backoff(policy)
    delays = [backoff.after_exit(0.5) for _ in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mode": "sometimes"}, "use one of on-failure, always, never"),
        ({"first_delay_s": 5.0, "max_delay_s": 1.0}, "first_delay_s <= max_delay_s"),
        ({"max_quick_failures": 0}, "at least 1"),
    ],
)
def test_bad_policies_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**kw)  # type: ignore[arg-type]


def test_ferry_up_takes_the_policy_from_the_command_line() -> None:
    assert build_parser().parse_args(["up"]).restart == "on-failure"
    assert build_parser().parse_args(["up", "--restart", "never"]).restart == "never"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--restart", "sometimes"])
