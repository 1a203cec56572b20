"""CI smoke of the load test: Locust headless for 20 s at 8 live AgentX-like sessions (4 over the
OpenAI REST API, 4 over the gRPC SDK) against a real `ferry up` cluster."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, ferry_up
from tests.redis_server import redis_server

pytestmark = pytest.mark.slow  # ~30 s of Locust against a cluster: `make test-slow`

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # 2048 blocks hold 8 full contexts many times over, and start faster than the default
    with (
        redis_server() as redis,
        ferry_up(redis.url, "--num-kv-blocks", "2048", cluster="smoke") as c,
    ):
        yield c


def test_agentx_sessions_run_without_failures(cluster: Cluster, tmp_path: Path) -> None:
    log, stats = tmp_path / "requests.jsonl", tmp_path / "stats"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOADTEST / "locustfile.py"),
        "--headless",
        "-u",
        "8",
        "-r",
        "8",
        "-t",
        "20s",
        "-s",
        "60",
        "--host",
        cluster.gateway,
        "--only-summary",
        "--csv",
        str(stats),
        "--agentx-log",
        str(log),
        "--agentx-grpc-host",
        cluster.grpc,
        "AgentChatUser",
        "AgentGrpcUser",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    *rows, last = [json.loads(line) for line in log.read_text().splitlines()]
    assert last["summary"] == {"started": len(rows), "finished": len(rows)}  # every one finished
    assert len(rows) >= 16 and {r["api"] for r in rows} == {"chat", "grpc"}
    for r in rows:
        assert r["ok"] and r["finish_reason"] == "length", r
        assert r["completion_tokens"] == r["max_tokens"]
        assert r["prompt_tokens"] == r["expected_prompt_tokens"]
    assert sum(r["cached_tokens"] for r in rows) > 0  # later turns reuse earlier contexts

    lines = Path(f"{stats}_stats.csv").read_text().splitlines()
    table = {(r["Type"], r["Name"]): r for r in csv.DictReader(lines)}
    assert int(table[("", "Aggregated")]["Failure Count"]) == 0
    for api in ("chat", "grpc"):
        for kind in ("TTFT", "TPOT", "ITL", "E2E"):
            row = table[(kind, api)]
            assert int(row["Request Count"]) > 0, row
            assert all(float(row[p]) > 0 for p in ("50%", "90%", "99%")), row
