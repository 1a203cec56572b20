"""When ``ferry up`` starts a dead child again: the restart policy and one unit's back-off.

Like a container runtime's restart policy: ``on-failure`` (the default) restarts a child that
exited with a non-zero code or was killed by a signal, and leaves one that stopped cleanly (it was
asked to: SIGTERM, a drain) down; ``always`` restarts that one too; ``never`` leaves every dead
child down. Restarts back off exponentially (1 s, 2 s, 4 s, ...), and a unit that keeps dying
soon after it starts is given up on, so that a crash loop ends instead of spinning for ever.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.services.common.listeners import USAGE_ERROR

RESTART_MODES = ("on-failure", "always", "never")


@dataclass(frozen=True)
class RestartPolicy:
    mode: str = "on-failure"
    first_delay_s: float = 1.0  # the first restart's wait; it doubles with each quick failure
    max_delay_s: float = 60.0
    stable_s: float = 60.0  # a unit that ran this long starts its back-off over
    max_quick_failures: int = 5  # this many exits in a row, each within stable_s: give up

    def __post_init__(self) -> None:
        if self.mode not in RESTART_MODES:
            raise ValueError(f"restart mode {self.mode!r}: use one of {', '.join(RESTART_MODES)}")
        if self.first_delay_s < 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError("restart delays: need 0 <= first_delay_s <= max_delay_s")
        if self.max_quick_failures < 1:
            raise ValueError("max_quick_failures must be at least 1")

    def wants(self, returncode: int) -> bool:
        """Whether a child that exited with ``returncode`` (negative: killed by that signal) is
        to be started again. Never one that exited 2: it cannot run as configured (a taken
        port, a bad flag), and would fail the same way again."""
        if returncode == USAGE_ERROR:
            return False
        return self.mode == "always" or (self.mode == "on-failure" and returncode != 0)


class Backoff:
    """One unit's restart history: how long to wait before the next start, or to give up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.quick_failures = 0  # exits in a row that came within stable_s of their start

    def after_exit(self, ran_s: float) -> float | None:
        """The unit exited after running ``ran_s`` seconds: the seconds to wait before starting
        it again, or None when it failed too often in a row to try again."""
        p = self.policy
        if ran_s >= p.stable_s:  # it had been up a while: not a crash loop
            self.quick_failures = 0
            return p.first_delay_s
        self.quick_failures += 1
        if self.quick_failures >= p.max_quick_failures:
            return None
        return min(p.max_delay_s, p.first_delay_s * 2 ** (self.quick_failures - 1))
