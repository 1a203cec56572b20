"""The AgentX-like workload generator (loadtest/agentx.py): seeded session trees, context
limits, forks, its trace files; and the figures of a served load's levels (loadtest/levels.py)
and of the sweep (loadtest/sweep.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from ferry.gateway.chat_template import ChatTemplate
from ferry.services.common.tokenizer import ByteTokenizer

# the load-test scripts import their shared modules as top-level ones (Locust and
# `python loadtest/x.py` put their folder on sys.path): so do the tests
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))
import levels
import sweep
from agentx import (
    Session,
    WorkloadConfig,
    generate_session,
    generate_sessions,
    prompt_tokens,
    read_trace,
    render_prompt,
    summary,
    system_prompt,
    write_trace,
)

CONFIG = WorkloadConfig(seed=7)


@pytest.fixture(scope="module")
def sessions() -> list[Session]:
    return generate_sessions(CONFIG, 0, 40)


def test_same_seed_same_sessions_other_seed_other_sessions() -> None:
    assert generate_session(CONFIG, 3) == generate_session(CONFIG, 3)
    assert generate_session(CONFIG, 3) != generate_session(CONFIG, 4)
    assert generate_session(CONFIG, 3) != generate_session(WorkloadConfig(seed=8), 3)


def test_prompt_tokens_are_what_the_gateway_tokenizes(sessions: list[Session]) -> None:
    tok, template = ByteTokenizer(), ChatTemplate()
    for request, messages in list(sessions[0].play())[:4]:
        text = template.render(messages, add_generation_prompt=True)
        assert request.prompt_tokens == len(tok.encode(text)) == prompt_tokens(messages)


def test_every_request_fits_and_contexts_reach_the_model_length(sessions: list[Session]) -> None:
    limit = CONFIG.max_context_tokens
    largest = [max(r.prompt_tokens + r.max_tokens for r in s.requests) for s in sessions]
    assert max(largest) <= limit
    assert sum(n > 0.8 * limit for n in largest) >= 0.75 * len(sessions)
    assert summary(sessions)["context_tokens_max"] > 0.95 * limit


def test_each_context_extends_its_parent_with_the_reply(sessions: list[Session]) -> None:
    for s in sessions[:10]:
        contexts = {}
        for request, messages in s.play():
            contexts[request.id] = messages
            if request.parent is None:
                assert [m["role"] for m in messages] == ["system", "user"]
                continue
            parent = contexts[request.parent]
            assert messages[: len(parent)] == parent
            assert messages[len(parent)]["role"] == "assistant"
            # the rendered prompt grows too: the prefix cache can reuse the parent's blocks
            parent_text = ChatTemplate().render(parent, add_generation_prompt=False)
            assert render_prompt(messages).startswith(parent_text)
            assert request.prompt_tokens > prompt_tokens(parent)


def test_sessions_share_the_system_prompt_and_nothing_after_it(sessions: list[Session]) -> None:
    firsts = [next(s.play())[1] for s in sessions]
    assert all(m[0]["content"] == system_prompt(CONFIG) for m in firsts)
    markers = [m[1]["content"].split("]")[0] for m in firsts]
    assert all(x.startswith("[session ") for x in markers)
    assert len(set(markers)) == len(markers)


def test_subagents_fork_from_a_main_turn_and_return_to_it() -> None:
    config = dataclasses.replace(CONFIG, subagent_probability=1.0, subagent_turns=(2, 2))
    s = generate_session(config, 0)
    by_id = {r.id: r for r in s.requests}
    sub = [r for r in s.requests if r.agent == "sub1"]
    assert len(sub) == 2 and by_id[sub[0].parent].agent == "main"
    assert sub[1].parent == sub[0].id
    fork = sub[0].parent
    # the parent's next request continues from the fork with the subagent's result
    (after,) = [r for r in s.requests if r.agent == "main" and r.parent == fork]
    assert s.requests.index(after) > s.requests.index(sub[-1])
    assert after.append[0]["role"] == "tool" and "sub1 returned" in after.append[0]["content"]


def test_think_times_and_outputs_follow_the_config(sessions: list[Session]) -> None:
    reqs = [r for s in sessions for r in s.requests]
    assert all(r.think_s == 0 for r in reqs if r.parent is None)
    thinks = [r.think_s for r in reqs if r.parent is not None]
    assert max(thinks) <= CONFIG.max_think_time_s
    assert 0.3 < sum(thinks) / len(thinks) < 0.7
    out = CONFIG.output_tokens
    assert all(out.low <= r.max_tokens <= out.high and len(r.reply) == r.max_tokens for r in reqs)
    quiet = generate_session(dataclasses.replace(CONFIG, think_time_s=0), 0)
    assert all(r.think_s == 0 for r in quiet.requests)


def test_a_trace_replays_the_same_sessions(tmp_path: Path, sessions: list[Session]) -> None:
    path = tmp_path / "trace.jsonl"
    n = write_trace(path, CONFIG, sessions[:5])
    config, replay = read_trace(path)
    assert config == CONFIG and replay == sessions[:5]
    assert n == sum(len(s.requests) for s in replay)
    assert [m for _, m in replay[2].play()] == [m for _, m in sessions[2].play()]


def test_a_bad_config_or_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no room"):
        WorkloadConfig(max_context_tokens=600)
    with pytest.raises(ValueError, match="tool_probability"):
        WorkloadConfig(tool_probability=1.5)
    path = tmp_path / "other.jsonl"
    path.write_text('{"something": 1}\n')
    with pytest.raises(ValueError, match="not an AgentX trace"):
        read_trace(path)


def row(ttft: float, tpot: float | None, tokens: int, ok: bool = True, **kw: object) -> dict:
    r = {
        "ok": ok,
        "sent_at": 100.0,
        "ttft": ttft,
        "tpot": tpot,
        "e2e": 2.0,
        "itl": [0.01, 0.03],
        "completion_tokens": tokens,
        "prompt_tokens": 1000,
        "cached_tokens": 600,
    }
    return {**r, **kw}


def test_level_stats_throughput_interactivity_goodput() -> None:
    rows = [
        row(0.5, 0.02, 50),
        row(3.0, 0.02, 50, sent_at=101.0),  # TTFT over the SLO
        row(0.5, 0.08, 50, sent_at=102.0),  # TPOT over it
        row(0.2, None, 0, ok=False),
    ]
    st = levels.level_stats(rows, workers=2, ttft_slo=1.0, tpot_slo=0.05)
    assert st["requests"] == 4 and st["failed"] == 1
    assert st["seconds"] == pytest.approx(4.0)  # first send at 100, last end at 102 + 2
    assert st["output_tokens_per_s"] == pytest.approx(150 / 4)
    assert st["output_tokens_per_s_per_worker"] == pytest.approx(150 / 8)
    assert st["tokens_per_s_per_user"] == pytest.approx(1 / 0.02)
    assert st["goodput"] == pytest.approx(1 / 4)  # a failed request misses the SLO too
    assert st["ttft_s"]["p50"] == pytest.approx(0.5) and st["itl_s"]["p50"] == pytest.approx(0.02)
    assert st["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert levels.level_stats([row(0.2, None, 0, ok=False)], 1, 1.0, 1.0)["failed"] == 1


def test_server_stats_are_differences_of_counters() -> None:
    before = {
        "ferry_scheduler_prompt_tokens_total": 100.0,
        "ferry_scheduler_cached_tokens_total": 10.0,
        'ferry_kv_transfer_bytes_total{transport="ucx"}': 5.0,
    }
    after = {
        "ferry_scheduler_prompt_tokens_total": 1100.0,
        "ferry_scheduler_cached_tokens_total": 810.0,
        'ferry_kv_transfer_bytes_total{transport="ucx"}': 105.0,
    }
    st = sweep.server_stats(before, after)
    assert st["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert st["kv_transfer_bytes"] == 100.0 and "expert_balancedness" not in st
    balanced = {**after, 'ferry_expert_balancedness{group="g"}': 0.9}
    assert sweep.server_stats(before, balanced)["expert_balancedness"] == {
        'ferry_expert_balancedness{group="g"}': 0.9
    }


def test_levels_get_disjoint_session_ranges() -> None:
    planned = levels.plan_levels([1, 2, 4], duration_s=10)
    assert [lv.concurrency for lv in planned] == [1, 2, 4]
    assert [lv.sessions for lv in planned] == [(0, 6), (6, 18), (18, 42)]


def test_plots_are_written(tmp_path: Path) -> None:
    level = {"concurrency": 1, **levels.level_stats([row(0.5, 0.02, 50)], 1, 1.0, 1.0)}
    res = {
        "config": "agg",
        "description": "one worker",
        "levels": [level],
        "model": {"preset": "tiny"},
        "duration_s": 30,
        "machine": {"cpus": 2, "note": ""},
    }
    (tmp_path / "serve-agg.json").write_text(json.dumps(res))
    sweep.main(["--configs", "agg", "--plot-only", "--out-dir", str(tmp_path)])
    for name in ("serve-pareto.png", "serve-ttft.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_the_table_has_a_row_per_level(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rows = [
        {
            "concurrency": c,
            **levels.level_stats([row(0.5, 0.02, 50)], 1, 1.0, 1.0),
            "server": {
                "kv_usage_max": 0.05,
                "prefix_cache_hit_rate": 0.6,
                "expert_balancedness": {'ferry_expert_balancedness{group="g"}': 0.9},
            },
        }
        for c in (1, 2)
    ]
    res = {"config": "1p-dep2", "worker_processes": 3, "levels": rows}
    (tmp_path / "serve-1p-dep2.json").write_text(json.dumps(res))
    sweep.main(["--configs", "1p-dep2", "--table", "--out-dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == sweep.TABLE_HEADER and len(lines) == 4
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert len(cells) == lines[0].count("|") - 1 == lines[1].count("|") - 1
    assert cells[:3] == ["1p-dep2", "3", "1"] and cells[-3:] == ["60% / 60%", "5.0%", "0.90"]
