"""One `ferry up` of the tiny model for both fuzzers, and the tally of the cases they sent,
written to ``loadtest/results/fuzz.json`` when the session ends. Afterwards the cluster must be
as it was: healthy, every KV block free, no worker restarted."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, ferry_up
from tests.fuzz.support import Tally
from tests.helpers import Checkpoint

RESULTS = Path(__file__).resolve().parents[2] / "loadtest" / "results" / "fuzz.json"
CHECKPOINT = Checkpoint(seed=5, lm_head_scale=20.0)


@pytest.fixture(scope="session")
def tallies() -> Iterator[dict[str, Tally]]:
    out = {
        "rest": Tally(("5xx", "not_openai_shape", "unreadable_2xx", "not_as_documented")),
        "grpc": Tally(("internal_or_unknown", "other_status", "no_message", "unreadable_reply")),
    }
    yield out
    RESULTS.write_text(
        json.dumps(
            {
                "command": "make fuzz",
                "rest": out["rest"].report(),
                "grpc": out["grpc"].report(),
            },
            indent=2,
        )
        + "\n"
    )


@pytest.fixture(scope="session")
def checkpoint(checkpoints: Callable[[Checkpoint], Path]) -> Path:
    """The fuzzers' model, for the session: their cluster is the session's."""
    return checkpoints(CHECKPOINT)


@pytest.fixture(scope="session")
def cluster(checkpoint: Path) -> Iterator[Cluster]:
    with ferry_up(
        "",
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        "256",
        "--worker-args",
        "--block-size 16",
        cluster="fuzz",
    ) as c:
        started = dict(c.pids)
        yield c
        c.wait_for("the gateway healthy", lambda: _healthy(c), 30)
        c.wait_for("every KV block free", c.all_blocks_free, 30)
        now = {v.record.worker_id: v.record.pid for v in c.views()}
        assert now == started and not c.said("restarting"), c.log_tail()


def _healthy(c: Cluster) -> bool:
    try:
        with urllib.request.urlopen(c.gateway + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
