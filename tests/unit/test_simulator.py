"""``ferry simulate`` (infra/simulator): the roofline's calibration against the measured H100
kernels, the model shapes, EPLB's imbalance, and small simulations driven by Ferry's own step
planner, KV cache manager and routing policies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ferry.infra.simulator import cli, sweep
from ferry.infra.simulator.calibration import MAX_ERROR, Efficiency, calibrate, production
from ferry.infra.simulator.cluster import (
    Deployment,
    SimSetup,
    Simulation,
    Slice,
    expert_slots,
    imbalance_at,
    imbalance_curve,
    summarize,
)
from ferry.infra.simulator.costs import load_model
from ferry.infra.simulator.hardware import get_hardware
from ferry.infra.simulator.workload import AgentX, Trace, Workload
from ferry.services.engine.model.full_size import DEEPSEEK_V3


@pytest.fixture(scope="module")
def calibrated() -> Efficiency:
    return calibrate()


def _setup(**kw: Any) -> SimSetup:
    """DeepSeek-V4-Flash on GB300 with production kernels, 14 simulated seconds."""
    base: dict[str, Any] = {
        "block_size": 256,
        "duration_s": 14.0,
        "warmup_s": 4.0,
        "min_window_s": 4.0,
        "target_requests": 10**9,
    }
    hardware = kw.pop("hardware", get_hardware("gb300"))
    eff = kw.pop("efficiency", production())
    return SimSetup(hardware, load_model("deepseek-v4-flash"), eff, **(base | kw))


def _run(
    setup: SimSetup, dep: Deployment, load: float, workload: Workload | None = None
) -> tuple[Simulation, dict[str, Any]]:
    sim = Simulation(setup, dep, workload or AgentX(), load)
    sim.run()
    return sim, summarize(sim)


def _trace(path: Path, sessions: int, output: int) -> Path:
    """Sessions of 4 turns, each prompt extending the one before by 300 tokens."""
    lines = [
        {"session": s, "prompt_len": 600 + 300 * turn, "output_len": output, "think_s": 0.2}
        for s in range(sessions)
        for turn in range(4)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# ---- the roofline -----------------------------------------------------------------------------


def test_held_out_kernels_and_decode_step_are_predicted_within_25_percent(
    calibrated: Efficiency,
) -> None:
    report = calibrated.report
    held = report["held_out"]
    assert {r["op"] for r in held} >= {"model_decode_step", "mla_decode", "fused_moe"}
    for row in held:
        assert abs(row["error"]) <= MAX_ERROR, row
    assert report["max_abs_error"] <= MAX_ERROR
    # fitted fractions of the peaks are fractions
    for c in report["fitted"].values():
        assert 0 < c["bw"] <= 1 and 0 < c["flops"] <= 1


def test_model_shapes_match_the_published_sizes() -> None:
    v3, v4 = load_model("deepseek-v3"), load_model("deepseek-v4-flash")
    assert v3.total_params == pytest.approx(671e9, rel=0.01)
    assert v3.active_params == pytest.approx(37e9, rel=0.05)
    assert v4.total_params == pytest.approx(284e9, rel=0.02)
    assert v4.active_params == pytest.approx(13e9, rel=0.05)
    assert v3.kv_bytes_per_token("bf16") == 61 * 576 * 2
    assert v4.kv_bytes_per_token("fp8") == pytest.approx(3850, rel=0.01)


def test_a_config_json_path_is_read_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    raw = {
        "model_type": "deepseek_v3",
        **{k: getattr(DEEPSEEK_V3, k) for k in ("vocab_size", "hidden_size", "intermediate_size")},
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shape = load_model(str(tmp_path))
    assert shape.total_params == load_model("deepseek-v3").total_params
    (tmp_path / "config.json").write_text(json.dumps(raw | {"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_model(str(tmp_path / "config.json"))


def test_eplb_imbalance_shrinks_with_tokens_and_with_redundant_experts() -> None:
    def curve(redundant: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return imbalance_curve(256, expert_slots(256, redundant, 64), 8, 64, 1, 0.5, 0.2, 0)

    plain, spare = curve(0), curve(64)
    assert imbalance_at(plain, 1e3) > imbalance_at(plain, 1e6) > 1.0
    assert imbalance_at(spare, 1e6) < imbalance_at(plain, 1e6)
    assert imbalance_at(imbalance_curve(256, 256, 8, 1, 1, 0.5, 0.2, 0), 10) == 1.0


# ---- simulations ------------------------------------------------------------------------------


def test_prefix_hits_come_from_the_kv_cache_manager_and_kv_aware_routing_keeps_them() -> None:
    dep = Deployment(4, 2, 2, 2)
    hits = {}
    for policy in ("kv_aware", "round_robin"):
        sim, point = _run(_setup(policy=policy), dep, 16)
        assert point["requests"] > 20
        hits[policy] = point["prefix_hit_rate"]
        ranks = [r for g in sim.prefill for r in g.ranks]
        for r in ranks:  # every block is free, cached or held by a live request or lease
            live = [q for q in r.planner.running + r.planner.waiting]
            r.kv.check_integrity(live)
        assert sum(r.kv.usage()["cached"] for r in ranks) > 0
    # AgentX turns extend their session's context: the rank that holds it serves most of it
    assert hits["kv_aware"] > 0.5
    assert hits["kv_aware"] > hits["round_robin"] + 0.1


def test_more_decode_gpus_give_more_throughput_at_a_fixed_load(
    calibrated: Efficiency, tmp_path: Path
) -> None:
    setup = _setup(efficiency=calibrated, min_decode_ranks=1)
    workload = Trace(_trace(tmp_path / "t.jsonl", 200, 400))  # decode-heavy
    totals = []
    for decode in (4, 12):  # a wider DEP group: fewer expert weights for each GPU to read
        dep = Deployment(4, 4, decode, decode)
        _, point = _run(setup, dep, 240, workload)
        totals.append(point["tok_s_per_gpu"] * dep.num_gpus)
    assert totals[1] > 1.5 * totals[0]


def test_the_slice_keeps_the_split_ratio() -> None:
    s = Slice.of(Deployment(16, 8, 56, 56), 4)
    assert (s.prefill_ranks, s.decode_ranks) == (2, 7)
    s = Slice.of(Deployment(8, 8, 64, 64), 4)
    assert (s.prefill_ranks, s.decode_ranks, s.share) == (1, 8, 0.125)


def test_slo_search_picks_the_fastest_point_that_meets_it() -> None:
    def point(tps: float, speed: float, ttft: float) -> dict[str, Any]:
        return {"tok_s_per_gpu": tps, "tok_s_per_user": {"p90": speed}, "ttft_s": {"p99": ttft}}

    points = [point(900, 50, 0.5), point(500, 150, 0.5), point(700, 150, 5.0), point(300, 300, 0.1)]
    best = sweep.best_point(points, sweep.Slo(ttft_s=2.0, tok_s_per_user=100))
    assert best is points[1]
    assert sweep.best_point(points, sweep.Slo(ttft_s=0.01, tok_s_per_user=None)) is None
    front = sweep.frontier(points, "tok_s_per_gpu")
    assert [p["tok_s_per_gpu"] for p in front] == [900, 700, 300]


# ---- the command -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        "--hardware tpu --gpus 8 --model deepseek-v3 --out x",
        "--hardware h100 --gpus 8 --model deepseek-v3",
        "--hardware h100 --gpus 8 --model deepseek-v3 --out x --decode-dep 0",
        "--hardware h100 --gpus 8 --model deepseek-v3 --out x --concurrency many",
    ],
)
def test_bad_flags_exit_2(argv: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv.split())
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpus", "1"], "--gpus"),
        (["--gpus", "8", "--model", "no-such-model"], "no-such-model"),
        (["--gpus", "8", "--prefill-gpus", "8"], "prefill GPUs"),
        (["--gpus", "8", "--prefill-gpus", "2", "--decode-dep", "4"], "DEP groups of 4"),
    ],
)
def test_bad_values_exit_2_with_the_reason(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--hardware", "h100", "--model", "deepseek-v3", "--out", str(tmp_path), *extra]
    if "--model" in extra:
        argv = argv[:2] + argv[4:]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_command_writes_the_json_and_the_plot(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "trace.jsonl", 40, 40)
    flags = (
        "--hardware gb300 --gpus 16 --model deepseek-v4-flash --prefill-gpus 8 --concurrency 1,16"
    )
    flags += " --duration-s 12 --processes 1 --efficiency production"
    flags += " --slo-ttft-s 5 --slo-tok-s-per-user 1"
    argv = [*flags.split(), "--trace", str(trace), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "out" / "simulation.json").read_text())
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 10_000
    assert result["command"].startswith("ferry simulate")
    assert result["calibration"]["max_abs_error"] <= MAX_ERROR
    assert len(result["points"]) == 2
    for p in result["points"]:
        assert {"tok_s_per_gpu", "total_tok_s_per_gpu", "deployment", "concurrency"} <= set(p)
        assert set(p["tok_s_per_user"]) == {"p50", "p90"} and set(p["ttft_s"]) == {"p50", "p99"}
        assert p["total_tok_s_per_gpu"] > p["tok_s_per_gpu"] > 0
    assert result["points"][1]["prefix_hit_rate"] > 0.3  # later turns extend earlier ones
    assert result["best"] is not None and sweep.Slo(5, 1).met(result["best"])
    assert [r["total_tok_s_per_gpu"] for r in result["reference"]["points"][:1]] == [954_000]
    assert "one_user" in result["reference"]["comparison"]


def test_a_trace_with_bad_lines_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"session": 1, "prompt_len": 10, "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        Trace(trace)
