"""What both fuzzers share: how hypothesis runs their cases, and the tally of what they sent."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings


def budget(cases: int) -> Callable[[Any], Any]:
    """At most ``cases`` cases (hypothesis stops early when a strategy has fewer), the same
    ones on every run: CI fails on a change, not on luck."""
    return settings(
        max_examples=cases,
        deadline=None,  # a case's time is the cluster's: its tests are elsewhere
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


@dataclass
class Tally:
    """Cases sent per REST route or gRPC method, the statuses they got, and the failures of
    each kind (``kinds``: those reported, found or not)."""

    kinds: tuple[str, ...]
    statuses: dict[str, Counter[str]] = field(default_factory=dict)
    failures: dict[str, Counter[str]] = field(default_factory=dict)

    def count(self, where: str, status: str) -> None:
        self.statuses.setdefault(where, Counter())[status] += 1

    def fail(self, where: str, kind: str) -> None:
        self.failures.setdefault(where, Counter())[kind] += 1

    def report(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for where, got in sorted(self.statuses.items()):
            failed = self.failures.get(where, Counter())
            out[where] = {
                "cases": sum(got.values()),
                **{kind: failed[kind] for kind in self.kinds},
                "statuses": dict(sorted(got.items())),
            }
        return out
