from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ferry.infra.ports import free_port
from ferry.infra.status import row
from ferry.services.common.cluster_state import ClusterState, LoadReport, WorkerRecord, WorkerView
from ferry.services.engine.model import load_model, prompt_logits
from tests.redis_server import redis_server


def _ferry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferry.infra.cli", *args], capture_output=True, text=True
    )


def test_export_preset_small_sharded(tmp_path: Path) -> None:
    run = _ferry("export-preset", "small", str(tmp_path), "--max-shard-bytes", str(64 << 20))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert (tmp_path / "tokenizer.json").exists()
    ids = list(range(1, 200, 5))
    torch.testing.assert_close(
        prompt_logits(load_model(tmp_path), ids),
        prompt_logits(load_model("small"), ids),
        rtol=0,
        atol=0,
    )


def test_unknown_preset_is_a_usage_error(tmp_path: Path) -> None:
    run = _ferry("export-preset", "huge", str(tmp_path))
    assert run.returncode == 2 and "invalid choice: 'huge'" in run.stderr


def test_every_serve_flag_names_its_environment_variable() -> None:
    run = _ferry("serve", "prefill", "--help")
    assert run.returncode == 0, run.stderr
    for env in ("FERRY_REDIS_URL", "FERRY_KV_TRANSPORT", "FERRY_BLOCK_SIZE", "FERRY_METRICS_PORT"):
        assert env in run.stdout


def test_help_shows_real_defaults_and_no_none() -> None:
    run = _ferry("up", "--help")
    assert run.returncode == 0, run.stderr
    assert "[FERRY_PREFILL]" in run.stdout and "[FERRY_PORT; 8000]" in run.stdout
    assert "None]" not in run.stdout


def test_the_api_key_never_goes_on_a_command_line(tmp_path: Path) -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    spec = cluster_spec(build_parser().parse_args(["up", "--api-key", "sesame"]))
    assert "sesame" not in " ".join(arg for args in spec.serve_args.values() for arg in args)
    assert spec.serve_env["gateway"]["FERRY_API_KEY"] == "sesame"
    key = tmp_path / "key"
    key.write_text("sesame\n")
    key.chmod(0o644)
    run = _ferry("serve", "gateway", "--api-key-file", str(key))
    assert run.returncode == 2 and "readable by other users" in run.stderr, run.stderr
    key.chmod(0o600)
    spec = cluster_spec(build_parser().parse_args(["up", "--api-key-file", str(key)]))
    assert spec.serve_env["gateway"]["FERRY_API_KEY"] == "sesame"
    run = _ferry("serve", "gateway", "--api-key", "x", "--api-key-file", str(key))
    assert run.returncode == 2 and "not both" in run.stderr, run.stderr


def test_kernels_reach_the_workers_in_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry.infra.cli import KERNEL_BACKENDS, build_parser, cluster_spec
    from ferry.infra.launcher import WORKER_ROLES
    from ferry.kernels.dispatch import BACKENDS

    assert KERNEL_BACKENDS == BACKENDS
    monkeypatch.delenv("FERRY_KERNELS", raising=False)
    spec = cluster_spec(build_parser().parse_args(["up"]))
    assert all(spec.serve_env[role]["FERRY_KERNELS"] == "auto" for role in WORKER_ROLES)
    spec = cluster_spec(build_parser().parse_args(["up", "--kernels", "torch"]))
    assert all(spec.serve_env[role]["FERRY_KERNELS"] == "torch" for role in WORKER_ROLES)
    assert "FERRY_KERNELS" not in spec.serve_env["gateway"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kernels", "cuda"])


def test_environment_variables_set_flag_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry.infra.cli import build_parser

    monkeypatch.setenv("FERRY_ROUTING_POLICY", "round_robin")
    monkeypatch.setenv("FERRY_MAX_ATTEMPTS", "5")
    args = build_parser().parse_args(["serve", "scheduler"])
    assert args.routing_policy == "round_robin" and args.max_attempts == 5
    args = build_parser().parse_args(["serve", "scheduler", "--max-attempts", "2"])
    assert args.max_attempts == 2  # a flag beats its variable


def test_status_without_redis_is_an_error_that_names_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    run = _ferry("status", "--redis-url", url)
    assert run.returncode == 1 and f"cannot reach Redis at {url}" in run.stderr


def test_status_lists_registered_workers() -> None:
    async def main(url: str) -> tuple[subprocess.CompletedProcess[str], ...]:
        state = ClusterState(url, "cli")

        def load() -> LoadReport:  # fresh every heartbeat, as a worker's is
            return LoadReport(
                running=2,
                free_kv_blocks=40,
                total_kv_blocks=64,
                cached_kv_blocks=8,
                updated_at=time.time(),
            )

        await state.register(WorkerRecord("decode-7", "decode", "127.0.0.1:9"), load)
        try:
            return await asyncio.gather(
                asyncio.to_thread(_ferry, "status", "--redis-url", url, "--cluster", "cli"),
                asyncio.to_thread(_ferry, "status", "--redis-url", url, "--cluster", "other"),
            )
        finally:
            await state.close()

    with redis_server() as redis:
        run, empty = asyncio.run(main(redis.url))
    assert run.returncode == 0, run.stderr
    header, line = run.stdout.splitlines()
    assert header.split()[:4] == ["worker", "role", "address", "health"]
    assert line.split() == [
        "decode-7",
        "decode",
        "127.0.0.1:9",
        "ok",
        "2",
        "0",
        "0",
        "24",
        "64",
        "8",
    ]
    assert "no workers registered in cluster 'other'" in empty.stdout


def _health(draining: bool, age: float) -> str:
    record = WorkerRecord("decode-0", "decode", "127.0.0.1:1", draining=draining)
    load = LoadReport(total_kv_blocks=8, free_kv_blocks=6, updated_at=100.0)
    return row(WorkerView(record, load), now=100.0 + age)[3]


def test_status_health_says_whether_a_worker_beats_and_whether_it_drains() -> None:
    assert _health(False, 0.5) == "ok"
    assert _health(False, 5.0) == "stale 5s"
    assert _health(True, 0.5) == "draining"
    assert _health(True, 5.0) == "draining, stale 5s"


def test_each_worker_role_takes_its_own_flags_after_the_shared_ones() -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    args = build_parser().parse_args(
        [
            "up",
            "--worker-args",
            "--block-size 16 --max-num-seqs 8",
            "--decode-args",
            "--max-num-seqs 64",
        ]
    )
    serve = cluster_spec(args).serve_args
    assert serve["decode"][-4:] == ["--max-num-seqs", "8", "--max-num-seqs", "64"]  # the last wins
    assert serve["prefill"][-2:] == serve["aggregated"][-2:] == ["--max-num-seqs", "8"]
    decode = build_parser().parse_args(["serve", "decode", *serve["decode"]])
    assert (decode.max_num_seqs, decode.block_size) == (64, 16)


def test_prefill_workers_split_the_cores_and_decode_workers_run_behind_them() -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    def worker(role: str, *flags: str) -> argparse.Namespace:
        spec = cluster_spec(build_parser().parse_args(["up", *flags]))
        return build_parser().parse_args(["serve", role, *spec.serve_args[role]])

    cores = os.cpu_count() or 1
    assert worker("prefill").torch_threads == cores
    assert worker("prefill", "--prefill", "2").torch_threads == max(1, cores // 2)
    assert worker("prefill", "--prefill-torch-threads", "3").torch_threads == 3
    assert (worker("prefill").nice, worker("decode").nice, worker("aggregated").nice) == (0, 19, 0)
    decode = worker("decode", "--decode-nice", "0", "--torch-threads", "2")
    assert (decode.nice, decode.torch_threads) == (0, 2)
    assert worker("decode", "--decode-args", "--nice 3").nice == 3  # a role's own flags win
    # small prefill steps run on one thread; decode and aggregated workers keep theirs
    ones = [worker(role).one_thread_below for role in ("prefill", "decode", "aggregated")]
    assert ones == [1024, 0, 0]
    assert worker("prefill", "--prefill-args", "--one-thread-below 0").one_thread_below == 0


def test_ferry_up_refuses_flags_a_worker_would_not_take_before_starting_anything() -> None:
    run = _ferry("up", "--decode-args", "--max-seqs 4", "--redis-url", "redis://127.0.0.1:1/0")
    assert run.returncode == 2, run.stderr
    assert (
        "ferry up: --worker-args / --decode-args: not flags of `ferry serve decode`" in run.stderr
    )
    assert "unrecognized arguments: --max-seqs 4" in run.stderr


def test_the_gateway_takes_several_scheduler_addresses_and_refuses_none() -> None:
    from ferry.infra.cli import build_parser
    from ferry.infra.flags import gateway_config

    args = build_parser().parse_args(["serve", "gateway", "--scheduler", "a:1, b:2,"])
    assert gateway_config(args).schedulers == ("a:1", "b:2")
    run = _ferry("serve", "gateway", "--scheduler", ",", "--port", str(free_port()))
    assert run.returncode == 2
    assert "ferry serve gateway: give at least one scheduler address" in run.stderr


def test_ferry_up_needs_a_scheduler() -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    with pytest.raises(ValueError, match="--schedulers 0: a cluster needs at least one"):
        cluster_spec(build_parser().parse_args(["up", "--schedulers", "0"]))
    assert cluster_spec(build_parser().parse_args(["up", "--schedulers", "3"])).schedulers == 3


def test_ferry_up_gives_every_service_its_keepalive_and_heartbeat_ttl() -> None:
    from ferry.infra.cli import ROLES, build_parser, cluster_spec
    from ferry.infra.flags import service_config

    args = build_parser().parse_args(["up", "--keepalive", "20", "--heartbeat-ttl", "6"])
    spec = cluster_spec(args)
    for role in ROLES:
        serve = build_parser().parse_args(["serve", role, *spec.serve_args[role]])
        assert serve.keepalive == 20.0, role
        if role != "gateway":  # the gateway is not in the registry
            config = service_config(serve)
            assert (config.ttl_s, config.heartbeat_s) == (6.0, 2.0), role


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["--keepalive", "0.5"], "ferry up: keepalive 0.5 s: at least 1 s"),
        (["--heartbeat-ttl", "0.1"], "ferry up: heartbeat TTL 0.1 s: at least 0.3 s"),
        (
            ["--decode-args", "--port 70000"],
            "ferry up: --worker-args / --decode-args: `ferry serve "
            "decode` would refuse them: port=70000: must be 0..65535",
        ),
        (
            ["--reasoning-parser", "r2"],
            "ferry up: flags: `ferry serve gateway` would refuse them: "
            "--reasoning-parser 'r2': one of deepseek_r1, or '' for none",
        ),
        (
            ["--tool-call-parser", "hermes"],
            "ferry up: flags: `ferry serve gateway` would refuse "
            "them: --tool-call-parser 'hermes': one of deepseek_v3, deepseek_v31",
        ),
    ],
)
def test_ferry_up_refuses_values_a_service_would_refuse(given: list[str], message: str) -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    with pytest.raises(ValueError) as refused:
        cluster_spec(build_parser().parse_args(["up", *given]))
    assert f"ferry up: {refused.value}" == message


def test_serve_refuses_a_keepalive_below_a_second_as_a_usage_error() -> None:
    run = _ferry("serve", "scheduler", "--keepalive", "0.5", "--port", str(free_port()))
    assert run.returncode == 2
    assert "ferry serve scheduler: keepalive 0.5 s: at least 1 s" in run.stderr


def test_port_0_is_any_free_port_and_no_gateway_is_a_flag_of_its_own() -> None:
    from ferry.infra.cli import build_parser, cluster_spec
    from ferry.infra.launcher import Launcher

    spec = cluster_spec(build_parser().parse_args(["up", "--port", "0", "--grpc-port", "0"]))
    ports = Launcher(spec).spec
    assert ports.gateway and ports.gateway_port > 0 and ports.grpc_port > 0
    assert not cluster_spec(build_parser().parse_args(["up", "--no-gateway"])).gateway


def test_tls_flags_go_together_and_reach_every_service(tmp_path: Path) -> None:
    from ferry.infra import certs
    from ferry.infra.cli import build_parser, cluster_spec

    files = certs.throwaway(tmp_path, "127.0.0.1")
    assert (tmp_path / "cluster.key").stat().st_mode & 0o077 == 0
    run = _ferry("serve", "scheduler", "--tls-cert", files.cert, "--port", str(free_port()))
    assert run.returncode == 2, run.stderr
    assert "--tls-cert, --tls-key and --tls-ca go together: give --tls-key, --tls-ca" in run.stderr
    run = _ferry("serve", "gateway", *files.flags()[:-1], str(tmp_path / "missing.pem"))
    assert run.returncode == 2 and "missing.pem: no such file, or not readable" in run.stderr
    spec = cluster_spec(build_parser().parse_args(["up", *files.flags()]))
    assert spec.tls == files and not spec.throwaway_tls
    with pytest.raises(ValueError, match="--tls makes its own certificates"):
        cluster_spec(build_parser().parse_args(["up", "--tls", *files.flags()]))


@pytest.mark.parametrize(
    ("argv", "unrecognized"),
    [
        # `ferry simulate` has --workload-scale and no --workload
        (
            "simulate --hardware h100 --gpus 8 --model deepseek-v3 --out x --workload agentx",
            "--workload agentx",
        ),
        ("serve scheduler --max-att 2", "--max-att 2"),
        ("up --aggr 2", "--aggr 2"),
        ("deploy k8s --out x --name ns", "--name ns"),
    ],
)
def test_a_flag_is_written_whole_not_abbreviated(
    argv: str, unrecognized: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ferry.infra.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv.split())
    assert exc.value.code == 2
    assert f"unrecognized arguments: {unrecognized}" in capsys.readouterr().err


def test_ferry_up_refuses_an_abbreviated_worker_flag() -> None:
    from ferry.infra.cli import build_parser, cluster_spec

    with pytest.raises(ValueError, match="not flags of `ferry serve decode`"):
        cluster_spec(build_parser().parse_args(["up", "--decode-args", "--max-num-seq 4"]))


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for a in subs for sub in a.choices.values() for p in _parsers(sub))]


def test_every_parser_ferry_makes_takes_no_abbreviations() -> None:
    """Every sub-command's parser, and every ArgumentParser(...) call in the tree."""
    import ast

    from ferry.infra.cli import build_parser

    assert all(not p.allow_abbrev for p in _parsers(build_parser()))
    root = Path(__file__).parents[2]
    calls = []
    for folder in ("infra", "services", "gateway", "loadtest", "kernels"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ArgumentParser"):
                    given = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    calls.append((str(path.relative_to(root)), given.get("allow_abbrev")))
    assert calls and [c for c in calls if c[1] != "False"] == []


def test_each_role_with_no_flags_builds_its_configs_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flag's default is its config field's: the two cannot drift."""
    from ferry.gateway.config import GatewayConfig
    from ferry.infra import flags
    from ferry.infra.cli import build_parser
    from ferry.services.eplb_controller.config import EplbConfig
    from ferry.services.scheduler.config import SchedulerConfig
    from ferry.services.worker.config import WorkerConfig

    for name in [n for n in os.environ if n.startswith("FERRY_")]:
        monkeypatch.delenv(name)

    def parse(role: str) -> argparse.Namespace:
        return build_parser().parse_args(["serve", role])

    assert flags.gateway_config(parse("gateway")) == GatewayConfig()
    assert flags.scheduler_config(parse("scheduler")) == SchedulerConfig()
    assert flags.eplb_config(parse("eplb")) == EplbConfig()
    for role in ("prefill", "decode", "aggregated"):
        assert flags.worker_config(parse(role)) == WorkerConfig()


def test_a_flag_whose_name_is_not_its_field_still_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry.infra import flags
    from ferry.infra.cli import build_parser

    monkeypatch.setenv("FERRY_GRACE", "7")
    monkeypatch.setenv("FERRY_NO_PREFIX_CACHING", "1")
    argv = ["serve", "decode", "--transfer-timeout", "4", "--dep-timeout", "2"]
    config = flags.worker_config(build_parser().parse_args(argv))
    assert (config.service.grace_s, config.engine.enable_prefix_caching) == (7.0, False)
    assert (config.transfer_timeout_s, config.dep_timeout_s) == (4.0, 2.0)
    argv = ["serve", "eplb", "--eplb-poll", "0.5", "--eplb-interval-steps", "9"]
    eplb = flags.eplb_config(build_parser().parse_args(argv))
    assert (eplb.poll_s, eplb.interval_steps) == (0.5, 9)


def test_help_shows_each_flags_variable_and_its_configs_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ferry.infra.cli import build_parser

    monkeypatch.setenv("FERRY_GRACE", "7")  # the variable sets the value, not the default shown
    decode = next(p for p in _parsers(build_parser()) if p.prog.endswith("serve decode"))
    text = " ".join(decode.format_help().split())
    for shown in ("[FERRY_GRACE; 5.0]", "[FERRY_MAX_NUM_SEQS; 256]", "[FERRY_NO_PREFIX_CACHING]"):
        assert shown in text, shown


def test_a_flag_naming_a_field_its_config_lacks_fails_at_once() -> None:
    from ferry.infra.flags import Flag, Flags
    from ferry.services.scheduler.config import SchedulerConfig

    with pytest.raises(TypeError, match="--max-retries: SchedulerConfig has no field"):
        Flags(SchedulerConfig, Flag("--max-retries", "tries"))
