"""The ``ferry`` command line: ``up`` (a local cluster), ``serve ROLE`` (one service),
``status`` (the cluster state in Redis) and ``export-preset``."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferry.gateway.config import GatewayConfig
from ferry.infra import flags
from ferry.infra.launcher import WORKER_ROLES
from ferry.infra.restarts import RESTART_MODES
from ferry.services.common.channels import KEEPALIVE_S
from ferry.services.common.config import ServiceConfig
from ferry.services.common.listeners import USAGE_ERROR, PortInUse, check_free
from ferry.services.engine.model.presets import PRESETS
from ferry.services.eplb_controller.config import EplbConfig
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from ferry.infra.launcher import ClusterSpec
    from ferry.services.common.server import Service

ROLES = ("prefill", "decode", "aggregated", "scheduler", "gateway", "eplb")


def _export_preset(args: argparse.Namespace) -> int:
    from ferry.services.engine.model.loader import export_preset

    path = export_preset(args.name, args.dir, max_shard_bytes=args.max_shard_bytes)
    print(f"wrote preset {args.name!r} as a HF checkpoint in {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ferry.services.common import channels, server, tls, tracing
    from ferry.services.common.log import configure_logging

    try:  # flags that no service could run with: a usage error, before anything starts
        channels.configure(args.keepalive)
        tls.configure(flags.tls_files(args))
        config = _role_config(args)
        for what, port, flag in _ports(args.role, config):
            check_free(args.host, port, what, flag)
        instance = (
            f"gateway-{config.port}"
            if isinstance(config, GatewayConfig)
            else config.service.name_for(args.role)
        )
        tracing.configure(args.role, instance, args.otlp_endpoint, args.trace_file)
    except (ValueError, PortInUse, OSError) as e:
        print(f"ferry serve {args.role}: {e}", file=sys.stderr)
        return USAGE_ERROR
    try:
        if isinstance(config, GatewayConfig):
            from ferry.gateway.server import main as serve_gateway

            return serve_gateway(config, args.log_level)
        cfg = config.service
        configure_logging(args.role, cfg.name_for(args.role), cfg.log_level)
        return server.main(cfg, _service(args.role, config))
    finally:
        tracing.shutdown()  # exports what is buffered: after a SIGTERM's graceful stop too


def _ports(
    role: str, config: GatewayConfig | SchedulerConfig | EplbConfig | WorkerConfig
) -> list[tuple[str, int, str]]:
    """(what, port, flag) of each listener ``role`` opens on a port given to it."""
    if isinstance(config, GatewayConfig):
        return [
            ("the gateway", config.port, "--port"),
            ("the gateway's gRPC API", config.grpc_port, "--grpc-port"),
        ]
    svc = config.service
    ports = [(f"the {role} gRPC server", svc.port, "--port")]
    ports += [("the metrics server", svc.metrics_port, "--metrics-port")]
    if isinstance(config, WorkerConfig):
        ports += [("the KV transfer server", config.kv_port, "--kv-port")]
    return ports


def _role_config(
    args: argparse.Namespace,
) -> GatewayConfig | SchedulerConfig | EplbConfig | WorkerConfig:
    if args.role == "gateway":
        return flags.gateway_config(args)
    if args.role == "scheduler":
        return flags.scheduler_config(args)
    if args.role == "eplb":
        return flags.eplb_config(args)
    return flags.worker_config(args)


def _service(role: str, config: SchedulerConfig | EplbConfig | WorkerConfig) -> Service:
    if isinstance(config, SchedulerConfig):
        from ferry.services.scheduler.service import Scheduler

        return Scheduler(config)
    if isinstance(config, EplbConfig):
        from ferry.services.eplb_controller.service import EplbController

        return EplbController(config)
    # only the role's own module: a process exports its own role's metric families alone
    if role == "prefill":
        from ferry.services.prefill_worker.service import PrefillWorker

        return PrefillWorker(config)
    if role == "aggregated":
        from ferry.services.decode_worker.aggregated import AggregatedWorker

        return AggregatedWorker(config)
    from ferry.services.decode_worker.service import DecodeWorker

    return DecodeWorker(config)


def _up(args: argparse.Namespace) -> int:
    from ferry.infra.launcher import run

    try:
        spec = cluster_spec(args)
    except ValueError as e:
        print(f"ferry up: {e}", file=sys.stderr)
        return 2
    return run(spec)


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """What `ferry up` starts, from its flags. ValueError when a role's extra flags are not
    flags of `ferry serve ROLE` (found now, not when every worker fails to start)."""
    from ferry.infra.launcher import ClusterSpec
    from ferry.infra.restarts import RestartPolicy
    from ferry.services.common import channels

    if args.schedulers < 1:
        raise ValueError(f"--schedulers {args.schedulers}: a cluster needs at least one")

    channels.keepalive_ms(args.keepalive)  # ferry up's own flags: found as theirs
    certs = flags.tls_files(args)
    if args.tls and certs.on:
        raise ValueError("--tls makes its own certificates: give it or --tls-cert/-key/-ca")
    ServiceConfig(ttl_s=args.heartbeat_ttl)
    every = ["--keepalive", str(args.keepalive), *_trace_flags(args)]  # every child's
    beats = [*every, "--heartbeat-ttl", str(args.heartbeat_ttl)]  # every registered service's
    worker = [
        *beats,
        "--model",
        args.model,
        "--kv-transport",
        args.kv_transport,
    ]
    if args.num_kv_blocks:
        worker += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.num_redundant_experts:
        worker += ["--num-redundant-experts", str(args.num_redundant_experts)]
    if args.router_skew:
        worker += ["--router-skew", str(args.router_skew)]
    if args.enforce_eager:
        worker += ["--enforce-eager"]
    serve_args = {
        "gateway": [
            *("--model", args.model),
            *(["--metrics-auth"] if args.metrics_auth else []),
            *("--migration-limit", str(args.migration_limit)),
            *("--reasoning-parser", args.reasoning_parser),
            *("--tool-call-parser", args.tool_call_parser),
            *every,
        ],
        "scheduler": [
            *("--routing-policy", args.routing_policy),
            *("--migration-limit", str(args.migration_limit)),
            *beats,
        ],
        "eplb": [
            *("--eplb-interval-steps", str(args.eplb_interval_steps)),
            *("--eplb-hash-interval-steps", str(args.eplb_hash_interval_steps)),
            *beats,
        ],
    }
    for role in WORKER_ROLES:  # its own flags last: they win over --worker-args
        serve_args[role] = [
            *worker,
            *_sharing(role, args),
            *shlex.split(args.worker_args),  # after ours: they win
            *shlex.split(getattr(args, f"{role}_args")),
        ]
        _check_serve_flags(role, serve_args[role], f"--worker-args / --{role}-args")
    for role in ("gateway", "scheduler", "eplb"):
        _check_serve_flags(role, serve_args[role], "flags")
    aggregated = args.aggregated
    return ClusterSpec(
        prefill=_pd_count(args.prefill, aggregated),
        decode=_pd_count(args.decode, aggregated),
        aggregated=aggregated,
        prefill_dep=args.prefill_dep,
        decode_dep=args.decode_dep,
        schedulers=args.schedulers,
        host=args.host,
        hosts=args.hosts,
        scheduler_port=args.scheduler_port,
        gateway=not args.no_gateway,
        gateway_port=args.port,
        grpc_port=args.grpc_port,
        redis_url=args.redis_url,
        cluster=args.cluster,
        restart=RestartPolicy(args.restart),
        serve_args=serve_args,
        serve_env={
            # the key reaches the gateway in its environment: argv is readable by any user
            # (OpenMP's default wait policy for prefill threads: PASSIVE, sleeping at every
            # barrier, made a 500-token prefill ~1.6x slower here, 118 -> 190 ms)
            "gateway": {"FERRY_API_KEY": flags.api_key(args), "FERRY_API_KEY_FILE": ""},
        },
        tls=certs,
        throwaway_tls=args.tls,
    )


def _trace_flags(args: argparse.Namespace) -> list[str]:
    """Every child sends its spans to --otlp-endpoint, and writes them to a file of its own in
    --trace-file's directory, named after it (its worker id; the gateway's: gateway-PORT)."""
    out = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    if args.trace_file:
        out += ["--trace-file", os.path.join(os.path.abspath(args.trace_file), "")]
    return out


def _sharing(role: str, args: argparse.Namespace) -> list[str]:
    """How a worker shares this machine's cores: prefill workers split them all (a prompt is
    big arithmetic; TTFT is what it sets), decode workers run behind them (--decode-nice: when
    both want a core, the prompt goes first, as llama.cpp puts prompts first in its batches)."""
    if role != "prefill":
        nice = args.decode_nice if role == "decode" else 0
        return ["--torch-threads", str(args.torch_threads), "--nice", str(nice)]
    threads = args.prefill_torch_threads
    if not threads:
        processes = _pd_count(args.prefill, args.aggregated)
        processes += args.prefill_dep if args.prefill_dep > 1 else 0
        threads = max(1, (os.cpu_count() or 1) // max(1, processes))
    return ["--torch-threads", str(threads)]


def _check_serve_flags(role: str, extra: list[str], source: str) -> None:
    from ferry.services.common import channels

    try:
        args = build_parser().parse_args(["serve", role, *extra])
    except SystemExit:  # argparse has printed what is wrong
        raise ValueError(f"{source}: not flags of `ferry serve {role}` (see above)") from None
    try:  # values that `ferry serve` would refuse
        channels.keepalive_ms(args.keepalive)
        _role_config(args)
    except ValueError as e:
        raise ValueError(f"{source}: `ferry serve {role}` would refuse them: {e}") from None


def _pd_count(given: int | None, aggregated: int) -> int:
    """Prefill or decode workers: as given, else 1, or 0 when aggregated workers are asked for
    (``ferry up --aggregated 2`` is two aggregated workers and nothing else)."""
    if given is not None:
        return given
    return 0 if aggregated else 1


def _status(args: argparse.Namespace) -> int:
    from ferry.infra.status import status
    from ferry.services.common.cluster_state import ClusterStateError

    try:
        print(asyncio.run(status(args.redis_url, args.cluster)))
    except (ClusterStateError, ValueError) as e:
        print(f"ferry status: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry: disaggregated MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)

    exp = sub.add_parser("export-preset", help="write a seeded random preset as a HF checkpoint")
    exp.add_argument("name", choices=sorted(PRESETS))
    exp.add_argument("dir", help="output directory (created if missing)")
    exp.add_argument("--max-shard-bytes", type=int, default=None, help="shard the safetensors")
    exp.set_defaults(func=_export_preset)

    up = sub.add_parser("up", help="start a local cluster (redis + all services)")
    flags.add(up, "--prefill", None, "prefill workers (default 1; 0 with --aggregated)", type=int)
    flags.add(up, "--decode", None, "decode workers (default 1; 0 with --aggregated)", type=int)
    flags.add(up, "--aggregated", 0, "aggregated workers (prefill and decode in one engine)")
    flags.add(up, "--prefill-dep", 1, "> 1: also a prefill DEP group of this many ranks")
    flags.add(up, "--decode-dep", 1, "> 1: also a decode DEP group of this many ranks")
    flags.add(up, "--num-redundant-experts", 0, "extra expert slots per MoE layer in a group")
    flags.add(
        up,
        "--eplb-interval-steps",
        1000,
        "the EPLB controller rebalances a group every N steps (0: only on request)",
    )
    flags.add(
        up,
        "--eplb-hash-interval-steps",
        -1,
        "... and its hash-routed layers (DeepSeek-V4) every N (-1: 10x the above)",
    )
    flags.add(up, "--router-skew", 0.0, "test knob: skew expert load on random weights")
    flags.add_switch(
        up, "--enforce-eager", "workers run every step eagerly (no compiled decode graphs)"
    )
    flags.add(
        up, "--model", "tiny", "preset (tiny, small, v4-tiny, v4-small) or HF checkpoint directory"
    )
    flags.add(up, "--redis-url", "", "Redis to use (default: start a private redis-server)")
    flags.add(up, "--kv-transport", "ucx", "KV transfer transport", choices=["ucx", "grpc"])
    flags.add(up, "--routing-policy", "kv_aware", "scheduler routing policy")
    flags.add(up, "--migration-limit", 0, "the scheduler's and the gateway's --migration-limit")
    flags.add(up, "--schedulers", 1, "scheduler replicas (the gateway spreads requests over them)")
    flags.add(up, "--host", "127.0.0.1", "address every service binds")
    flags.add(
        up,
        "--hosts",
        0,
        "run as N hosts: network namespaces on a bridge, redis on the first, the gateway and "
        "scheduler on the second, workers over the rest (root; 0: all on --host)",
    )
    flags.add(up, "--port", 8000, "the OpenAI API's HTTP port (0: any free port)")
    flags.add_switch(up, "--no-gateway", "start no gateway (clients call the scheduler)")
    flags.add_key_flags(up, "the gateway requires `Authorization: Bearer KEY`")
    flags.add_switch(
        up, "--tls", "mutual TLS inside, HTTPS outside, with a throwaway CA made for this run"
    )
    flags.add_tls_flags(up)
    flags.add(up, "--reasoning-parser", "", "the gateway's --reasoning-parser (deepseek_r1)")
    flags.add(up, "--tool-call-parser", "deepseek_v3", "the gateway's --tool-call-parser")
    flags.add(up, "--grpc-port", 50051, "the gateway's public gRPC port")
    flags.add(up, "--scheduler-port", 50052, "the first scheduler's gRPC port (0: any free)")
    flags.add(up, "--cluster", "default", "cluster name (Redis key prefix)")
    flags.add(up, "--num-kv-blocks", 0, "KV cache blocks per worker (0: from memory)")
    flags.add(up, "--torch-threads", 1, "torch threads per decode or aggregated worker")
    flags.add(
        up,
        "--prefill-torch-threads",
        0,
        "torch threads per prefill worker (0: the machine's cores, split among them)",
    )
    flags.add(
        up,
        "--decode-nice",
        5,
        "decode workers' CPU priority below the rest (0..19): prompts first on shared cores",
    )
    flags.add(up, "--keepalive", KEEPALIVE_S, "every service's --keepalive (gRPC ping period)")
    flags.add(up, "--heartbeat-ttl", ServiceConfig.ttl_s, "every service's --heartbeat-ttl")
    flags.add_tracing_flags(up, "a directory: every service appends its spans to NAME.jsonl in it")
    flags.add(up, "--worker-args", "", "extra `ferry serve` flags for every worker")
    for role in WORKER_ROLES:
        flags.add(up, f"--{role}-args", "", f"extra `ferry serve` flags for the {role} workers")
    flags.add(
        up,
        "--restart",
        "on-failure",
        "start a dead child again (a DEP group as one): after a crash, after any exit, or never",
        choices=list(RESTART_MODES),
    )
    up.set_defaults(func=_up)

    serve = sub.add_parser("serve", help="run one service (the unit a pod runs)")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        p = roles.add_parser(role, help=f"the {role} service")
        if role == "gateway":
            flags.add_gateway_flags(p)
            continue
        flags.add_service_flags(p)
        if role == "scheduler":
            flags.add_scheduler_flags(p)
        elif role == "eplb":
            flags.add_eplb_flags(p)
        else:
            flags.add_engine_flags(p)
    serve.set_defaults(func=_serve)

    st = sub.add_parser("status", help="workers, health, load and KV usage from Redis")
    flags.add(st, "--redis-url", "redis://127.0.0.1:6379/0", "Redis holding the cluster state")
    flags.add(st, "--cluster", "default", "cluster name")
    st.set_defaults(func=_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
