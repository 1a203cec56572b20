"""The ``ferry`` command line: ``up`` (a local cluster), ``deploy k8s`` (its Kubernetes
manifests), ``simulate`` (a deployment at rack scale, simulated), ``serve ROLE`` (one service),
``status`` (the cluster state in Redis) and ``export-preset``."""

from __future__ import annotations

import argparse
import asyncio
import operator
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferry.gateway.config import GatewayConfig
from ferry.infra import flags
from ferry.infra.deploy.k8s import K8sOptions
from ferry.infra.flags import Flag, Flags, option, switch
from ferry.infra.launcher import WORKER_ROLES, ClusterSpec
from ferry.infra.restarts import RESTART_MODES, RestartPolicy
from ferry.infra.simulator import cli as simulator_cli
from ferry.services.common.channels import KEEPALIVE_S
from ferry.services.common.config import ServiceConfig
from ferry.services.common.listeners import USAGE_ERROR, PortInUse, check_free
from ferry.services.engine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from ferry.services.engine.model.presets import PRESETS
from ferry.services.eplb_controller.config import EplbConfig
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from ferry.services.common.server import Service

ROLES = ("prefill", "decode", "aggregated", "scheduler", "gateway", "eplb")
# A prefill step of fewer new tokens runs on one thread. At 32 agentic sessions on 2 cores
# (bench-peer's workload: one prompt of a few hundred new tokens at a time, the first 32 at once)
# it served 10% more tokens/s, the TTFT p99 the same (1.07 against 1.09 s), p50 0.43 against 0.29.
PREFILL_ONE_THREAD_BELOW = 1024
# kernels.dispatch.BACKENDS, which the CLI cannot import: it loads torch (test_cli compares them)
KERNEL_BACKENDS = ("auto", "torch", "triton", "native")


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
        from ferry.services.worker.prefill import PrefillWorker

        return PrefillWorker(config)
    if role == "aggregated":
        from ferry.services.worker.aggregated import AggregatedWorker

        return AggregatedWorker(config)
    from ferry.services.worker.decode import DecodeWorker

    return DecodeWorker(config)


def _up(args: argparse.Namespace) -> int:
    from ferry.infra.launcher import run

    try:
        spec = cluster_spec(args)
    except ValueError as e:
        print(f"ferry up: {e}", file=sys.stderr)
        return 2
    return run(spec)


def cluster_spec(args: argparse.Namespace, worker_cores: int = 0) -> ClusterSpec:
    """What `ferry up` starts (and `ferry deploy k8s` renders), from its flags. ValueError when a
    role's extra flags are not flags of `ferry serve ROLE` (found now, not when every worker
    fails to start). ``worker_cores``: each worker has this many cores of its own (a pod's);
    0: the workers share this machine's."""
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
    worker += ["--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype]
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
            *_sharing(role, args, worker_cores),
            *shlex.split(args.worker_args),  # after ours: they win
            *shlex.split(getattr(args, f"{role}_args")),
        ]
        _check_serve_flags(role, serve_args[role], f"--worker-args / --{role}-args")
    for role in ("gateway", "scheduler", "eplb"):
        _check_serve_flags(role, serve_args[role], "flags")
    return CLUSTER.build(
        args,
        prefill=_pd_count(args.prefill, args.aggregated),
        decode=_pd_count(args.decode, args.aggregated),
        serve_args=serve_args,
        serve_env={
            # the key reaches the gateway in its environment: argv is readable by any user
            "gateway": {"FERRY_API_KEY": flags.api_key(args), "FERRY_API_KEY_FILE": ""},
            # (no OMP_WAIT_POLICY for the workers: PASSIVE, sleeping at every barrier, made
            # prefill markedly slower on this machine's two cores)
            **{role: {"FERRY_KERNELS": args.kernels} for role in WORKER_ROLES},
        },
        tls=certs,
    )


def _trace_flags(args: argparse.Namespace) -> list[str]:
    """Every child sends its spans to --otlp-endpoint, and writes them to a file of its own in
    --trace-file's directory, named after it (its worker id; the gateway's: gateway-PORT)."""
    out = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    if args.trace_file:
        out += ["--trace-file", os.path.join(os.path.abspath(args.trace_file), "")]
    return out


def _sharing(role: str, args: argparse.Namespace, own_cores: int = 0) -> list[str]:
    """How a worker shares this machine's cores: prefill workers split them all (a prompt is
    big arithmetic; TTFT is what it sets) for steps of PREFILL_ONE_THREAD_BELOW tokens or more,
    and run smaller ones on one thread, leaving the other cores to decode; decode workers run
    behind them (--decode-nice: when both want a core, the prompt goes first, as llama.cpp puts
    prompts first in its batches). ``own_cores``: a prefill worker has this many to itself."""
    if role != "prefill":
        nice = args.decode_nice if role == "decode" else 0
        return ["--torch-threads", str(args.torch_threads), "--nice", str(nice)]
    threads = args.prefill_torch_threads or own_cores
    if not threads:
        processes = _pd_count(args.prefill, args.aggregated)
        processes += args.prefill_dep if args.prefill_dep > 1 else 0
        threads = max(1, (os.cpu_count() or 1) // max(1, processes))
    return ["--torch-threads", str(threads), "--one-thread-below", str(PREFILL_ONE_THREAD_BELOW)]


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


def _deploy_k8s(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ferry.infra.deploy.k8s import Renderer, write

    try:
        opts = _k8s_options(args)
        spec = cluster_spec(args, worker_cores=opts.worker_cpus)
        objects = Renderer(spec, opts, args.model).render()
    except ValueError as e:
        print(f"ferry deploy k8s: {e}", file=sys.stderr)
        return USAGE_ERROR
    command = shlex.join(["ferry", *sys.argv[1:]]) if sys.argv[1:] else "ferry deploy k8s"
    paths = write(objects, Path(args.out), command)
    kinds = sorted({o["kind"] for o in objects})
    print(f"wrote {len(paths)} objects ({', '.join(kinds)}) to {args.out}")
    if any(o["kind"] in ("LeaderWorkerSet", "DisaggregatedSet") for o in objects):
        print("the cluster needs the LeaderWorkerSet controller (kubernetes-sigs/lws)")
    return 0


def _k8s_options(args: argparse.Namespace) -> K8sOptions:
    """`ferry deploy k8s`'s own flags; ValueError for `ferry up` flags that a Kubernetes
    cluster cannot take as they are (a secret in a manifest, this machine's files)."""
    if args.hosts:
        raise ValueError("--hosts runs namespaces on this machine: pods have hosts of their own")
    if args.tls or flags.tls_files(args).on:
        raise ValueError("TLS in pods comes from a Secret: give --tls-secret NAME")
    if flags.api_key(args):  # flags.api_key reads --api-key, --api-key-file and FERRY_API_KEY
        raise ValueError(
            "an API key in a manifest is a leaked key: put it in a Secret "
            "(kubectl create secret generic NAME --from-literal=api-key=...) and give "
            "--api-key-secret NAME"
        )
    if args.restart != "on-failure":
        raise ValueError("--restart: Kubernetes restarts pods itself (restartPolicy Always)")
    if args.model not in PRESETS:
        if not args.model_pvc:
            raise ValueError(
                f"--model {args.model}: a pod cannot see this machine's files; give "
                "--model-pvc CLAIM, a volume holding the checkpoint, mounted at this path"
            )
        if not os.path.isabs(args.model):
            raise ValueError(f"--model {args.model}: with --model-pvc, an absolute path")
    selector = {}
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--node-selector {item}: give KEY=VALUE")
        selector[key] = value
    return K8S.build(args, node_selector=selector)


# `ferry deploy k8s`'s own flags, besides --out and --node-selector
K8S = Flags(
    K8sOptions,
    Flag("--namespace", "the namespace of every object"),
    Flag("--image", "the image every Ferry pod runs (infra/docker/Dockerfile)"),
    Flag(
        "--image-pull-policy",
        "the pods' imagePullPolicy",
        choices=["IfNotPresent", "Always", "Never"],
    ),
    Flag("--redis-image", "the image of the cluster's own Redis"),
    Flag("--worker-cpus", "CPUs each worker pod requests (a prefill's torch threads)"),
    Flag("--worker-memory", "memory each worker pod requests and is limited to"),
    Flag("--shm-size", "each worker's /dev/shm (UCX and torch use it)"),
    Flag("--gpus", "GPUs per worker pod"),
    Flag("--gpu-resource", "the GPUs' extended resource name"),
    Flag("--rdma-resource", "an RDMA device per worker pod (e.g. rdma/ib) and IPC_LOCK"),
    switch("--host-network", "workers on their node's network (UCX over its NICs)"),
    Flag("--ucx-tls", "the workers' UCX_TLS (default: UCX picks)"),
    Flag("--model-pvc", "a PersistentVolumeClaim holding --model's checkpoint"),
    Flag("--api-key-secret", "a Secret whose key api-key the gateway requires"),
    Flag("--tls-secret", "a Secret with tls.crt, tls.key, ca.crt: mutual TLS inside"),
    Flag("--gateway-replicas", "gateway pods behind its Service"),
    Flag(
        "--gateway-service-type",
        "the gateway Service's type",
        choices=["ClusterIP", "NodePort", "LoadBalancer"],
    ),
    switch("--disaggregated-set", "the worker roles as one DisaggregatedSet (LWS's) of roles"),
    switch("--pod-monitor", "a Prometheus Operator PodMonitor for every pod"),
)


def _add_k8s_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for the manifests (one per object)")
    flags.add_flags(p, K8S)
    p.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a node label the worker pods need (repeatable)",
    )


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
    parser = flags.Parser(prog="ferry", description="Ferry: disaggregated MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)

    exp = sub.add_parser("export-preset", help="write a seeded random preset as a HF checkpoint")
    exp.add_argument("name", choices=sorted(PRESETS))
    exp.add_argument("dir", help="output directory (created if missing)")
    exp.add_argument("--max-shard-bytes", type=int, default=None, help="shard the safetensors")
    exp.set_defaults(func=_export_preset)

    up = sub.add_parser("up", help="start a local cluster (redis + all services)")
    flags.add_flags(up, CLUSTER)
    up.set_defaults(func=_up)

    deploy = sub.add_parser("deploy", help="deployment artefacts for a cluster")
    targets = deploy.add_subparsers(dest="target", required=True)
    k8s = targets.add_parser(
        "k8s",
        help="Kubernetes manifests for the cluster `ferry up` would start with these flags",
    )
    flags.add_flags(k8s, CLUSTER)
    _add_k8s_flags(k8s)
    k8s.set_defaults(func=_deploy_k8s)

    simulator_cli.add_parser(sub)

    serve = sub.add_parser("serve", help="run one service (the unit a pod runs)")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        p = roles.add_parser(role, help=f"the {role} service")
        flags.add_flags(p, *flags.ROLE_FLAGS[role])
    serve.set_defaults(func=_serve)

    st = sub.add_parser("status", help="workers, health, load and KV usage from Redis")
    status_flags = (
        option("--redis-url", ServiceConfig.redis_url, "Redis holding the cluster state"),
        option("--cluster", ServiceConfig.cluster, "cluster name"),
    )
    flags.add_flags(st, status_flags)
    st.set_defaults(func=_status)
    return parser


# What a cluster is made of: `ferry up`'s flags, which `ferry deploy k8s` takes too (one
# ClusterSpec from both: they cannot drift). A flag that sets no field of it is handed on to
# the services (cluster_spec); where its default is a service's own, it is read from that
# service's config.
CLUSTER = Flags(
    ClusterSpec,
    option("--prefill", None, "prefill workers (default 1; 0 with --aggregated)", type=int),
    option("--decode", None, "decode workers (default 1; 0 with --aggregated)", type=int),
    Flag("--aggregated", "aggregated workers (prefill and decode in one engine)"),
    Flag("--prefill-dep", "> 1: also a prefill DEP group of this many ranks"),
    Flag("--decode-dep", "> 1: also a decode DEP group of this many ranks"),
    option(
        "--num-redundant-experts",
        WorkerConfig.num_redundant_experts,
        "extra expert slots per MoE layer in a group",
    ),
    option(
        "--eplb-interval-steps",
        1000,
        "the EPLB controller rebalances a group every N steps (0: only on request)",
    ),
    option(
        "--eplb-hash-interval-steps",
        EplbConfig.hash_interval_steps,
        "... and its hash-routed layers (DeepSeek-V4) every N (-1: 10x the above)",
    ),
    option(
        "--router-skew", EngineConfig.router_skew, "test knob: skew expert load on random weights"
    ),
    option("--dtype", EngineConfig.dtype, "the workers' --dtype", choices=list(DTYPES)),
    option(
        "--kv-cache-dtype",
        EngineConfig.kv_cache_dtype,
        "the workers' --kv-cache-dtype (fp8: DeepSeek-V4.1's FP8 cache)",
        choices=list(KV_CACHE_DTYPES),
    ),
    switch(
        "--enforce-eager",
        "workers run every step eagerly (no compiled decode graphs)",
        field=None,
    ),
    option(
        "--kernels",
        "auto",
        "the workers' kernels: auto (C on the CPU where an op has one, Triton on CUDA), "
        "torch (the reference: the fast CPU path off), native, triton",
        choices=KERNEL_BACKENDS,
    ),
    option(
        "--model",
        EngineConfig.model,
        "preset (tiny, small, v4-tiny, v4-small, v41-tiny, v41-small) or HF checkpoint directory",
    ),
    Flag("--redis-url", "Redis to use (default: start a private redis-server)"),
    option(
        "--kv-transport",
        WorkerConfig.kv_transport,
        "KV transfer transport",
        choices=["ucx", "grpc"],
    ),
    option("--routing-policy", SchedulerConfig.routing_policy, "scheduler routing policy"),
    option(
        "--migration-limit",
        SchedulerConfig.migration_limit,
        "the scheduler's and the gateway's --migration-limit",
    ),
    Flag("--schedulers", "scheduler replicas (the gateway spreads requests over them)"),
    Flag("--host", "address every service binds"),
    Flag(
        "--hosts",
        "run as N hosts: network namespaces on a bridge, redis on the first, the gateway and "
        "scheduler on the second, workers over the rest (root; 0: all on --host)",
    ),
    Flag("--port", "the OpenAI API's HTTP port (0: any free port)", field="gateway_port"),
    switch(
        "--no-gateway",
        "start no gateway (clients call the scheduler)",
        field="gateway",
        to_field=operator.not_,
    ),
    *flags.api_key_flags("the gateway requires `Authorization: Bearer KEY`", metrics_auth=None),
    switch(
        "--tls",
        "mutual TLS inside, HTTPS outside, with a throwaway CA made for this run",
        field="throwaway_tls",
    ),
    *flags.TLS,
    option(
        "--reasoning-parser",
        GatewayConfig.reasoning_parser,
        "the gateway's --reasoning-parser (deepseek_r1)",
    ),
    option(
        "--tool-call-parser",
        GatewayConfig.tool_call_parser,
        "the gateway's --tool-call-parser",
    ),
    Flag("--grpc-port", "the gateway's public gRPC port"),
    Flag("--scheduler-port", "the first scheduler's gRPC port (0: any free)"),
    Flag("--cluster", "cluster name (Redis key prefix)"),
    option("--num-kv-blocks", 0, "KV cache blocks per worker (0: from memory)"),
    option("--torch-threads", 1, "torch threads per decode or aggregated worker"),
    option(
        "--prefill-torch-threads",
        0,
        "torch threads per prefill worker (0: the machine's cores, split among them)",
    ),
    option(
        "--decode-nice",
        19,
        "decode workers' CPU priority below the rest (0..19): prompts first on shared cores",
    ),
    option("--keepalive", KEEPALIVE_S, "every service's --keepalive (gRPC ping period)"),
    option("--heartbeat-ttl", ServiceConfig.ttl_s, "every service's --heartbeat-ttl"),
    *flags.tracing("a directory: every service appends its spans to NAME.jsonl in it"),
    option("--worker-args", "", "extra `ferry serve` flags for every worker"),
    *(
        option(f"--{role}-args", "", f"extra `ferry serve` flags for the {role} workers")
        for role in WORKER_ROLES
    ),
    Flag(
        "--restart",
        "start a dead child again (a DEP group as one): after a crash, after any exit, or never",
        default=RestartPolicy.mode,
        choices=list(RESTART_MODES),
        to_field=RestartPolicy,
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
