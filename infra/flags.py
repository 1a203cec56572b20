"""Command-line flags of the services, each with a FERRY_* environment variable, and the
configs they build. This is the one place that reads FERRY_* variables for services."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ferry.gateway.config import GatewayConfig
from ferry.services.common.channels import KEEPALIVE_S
from ferry.services.common.config import ServiceConfig
from ferry.services.common.tls import TlsFiles
from ferry.services.engine.config import DTYPES, EngineConfig
from ferry.services.eplb_controller.config import EplbConfig
from ferry.services.kv_transfer.registry import transport_names
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.policies import POLICIES
from ferry.services.worker.config import WorkerConfig

_TRUE = {"1", "true", "yes", "on"}


def env_name(flag: str) -> str:
    return "FERRY_" + flag.lstrip("-").upper().replace("-", "_")


def add(parser: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    """``flag`` whose default comes from FERRY_<FLAG> when set."""
    env = env_name(flag)
    kind = kw.pop("type", type(default) if default is not None else str)
    raw = os.environ.get(env)
    value = kind(raw) if raw is not None else default
    # no value (None, ""): the help's own words say what that means ("default 1; 0 with ...")
    shown = env if default in (None, "") else f"{env}; {default}"
    parser.add_argument(flag, type=kind, default=value, help=f"{help} [{shown}]", **kw)


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    env = env_name(flag)
    on = os.environ.get(env, "").lower() in _TRUE
    parser.add_argument(flag, action="store_true", default=on, help=f"{help} [{env}]")


def add_service_flags(p: argparse.ArgumentParser) -> None:
    d = ServiceConfig()
    add(p, "--worker-id", d.worker_id, "unique name in the cluster (default: role-host-pid)")
    add(p, "--host", d.host, "gRPC bind address")
    add(p, "--port", d.port, "gRPC port (0: any free port)")
    add(p, "--advertise-host", d.advertise_host, "host that other services dial")
    add(p, "--metrics-port", d.metrics_port, "Prometheus /metrics port (0: any, -1: off)")
    add(p, "--redis-url", d.redis_url, "Redis holding the cluster state")
    add(p, "--cluster", d.cluster, "cluster name (Redis key prefix)")
    add(p, "--grace", d.grace_s, "seconds in-flight RPCs get on SIGTERM")
    add(
        p,
        "--heartbeat-ttl",
        d.ttl_s,
        "seconds a worker's registry record outlives its last "
        "heartbeat (it beats every TTL/3; a scheduler takes one whose record expired for hung)",
    )
    _add_keepalive(p)
    add_tls_flags(p)
    add_tracing_flags(p)
    add(p, "--log-level", d.log_level, "log level", choices=["debug", "info", "warning", "error"])


def _add_keepalive(p: argparse.ArgumentParser) -> None:
    add(
        p,
        "--keepalive",
        KEEPALIVE_S,
        "seconds between pings on each gRPC connection; a peer "
        "that does not answer within as long is taken for hung and its calls fail",
    )


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """Mutual TLS between the services (services/common/tls.py); all three or none."""
    add(p, "--tls-cert", "", "PEM certificate this process shows its peers (and HTTPS clients)")
    add(p, "--tls-key", "", "PEM private key of --tls-cert")
    add(p, "--tls-ca", "", "PEM CA that signs every peer's certificate")


def add_tracing_flags(p: argparse.ArgumentParser, trace_file: str = "") -> None:
    """OpenTelemetry spans of the requests (services/common/tracing.py); neither: none."""
    add(p, "--otlp-endpoint", "", "send trace spans to this OTLP/gRPC collector (HOST:PORT)")
    add(
        p,
        "--trace-file",
        "",
        trace_file
        or "append trace spans as JSON lines to this file (a directory, or a path ending in /: "
        "WORKER-ID.jsonl in it)",
    )


def tls_files(args: argparse.Namespace) -> TlsFiles:
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d, w = EngineConfig(), WorkerConfig()
    add(p, "--model", d.model, "preset (tiny, small, v4-tiny, v4-small) or HF checkpoint directory")
    add(p, "--dtype", d.dtype, "weights and KV cache dtype", choices=list(DTYPES))
    add(
        p,
        "--block-size",
        d.block_size,
        "tokens per KV block (default: the model's: 64, or a multiple of its compression ratios)",
        type=int,
    )
    add(p, "--num-kv-blocks", None, "KV cache size in blocks (default: from memory)", type=int)
    add(p, "--kv-cache-memory-bytes", None, "KV cache budget in bytes", type=int)
    add(p, "--max-num-seqs", d.max_num_seqs, "running requests per step")
    add(p, "--max-num-batched-tokens", d.max_num_batched_tokens, "tokens per step")
    add(p, "--max-model-len", None, "context limit (default: the model's)", type=int)
    add_switch(p, "--no-prefix-caching", "turn the prefix cache off")
    add(p, "--kv-transport", w.kv_transport, "KV transfer transport", choices=transport_names())
    add(p, "--kv-port", w.kv_port, "KV transport listener port (prefill; 0: any)")
    add(p, "--lease-seconds", w.lease_seconds, "how long exported KV waits for its pull")
    add(p, "--transfer-timeout", w.transfer_timeout_s, "seconds a KV pull may take")
    add_switch(p, "--verify-checksum", "CRC32-check every KV transfer")
    add(
        p,
        "--kv-probe-interval",
        w.kv_probe_interval_s,
        "seconds between checks that the KV transport can still connect (0: none)",
    )
    add(p, "--torch-threads", w.torch_threads, "torch intra-op threads (0: torch's default)")
    add(p, "--nice", w.nice, "lower this worker's CPU priority by N (0..19): others go first")
    add(p, "--dep-size", w.dep_size, "ranks in this worker's DEP group (1: none)")
    add(p, "--dep-rank", w.dep_rank, "this worker's rank in its DEP group")
    add(p, "--dep-master", w.dep_master, "host:port where the group's ranks meet")
    add(p, "--dep-group", w.dep_group, "the group's name in Redis (default: the master address)")
    add(p, "--num-redundant-experts", w.num_redundant_experts, "extra expert slots per layer")
    add(p, "--dep-timeout", w.dep_timeout_s, "seconds before a silent rank fails its group")
    add(p, "--router-skew", d.router_skew, "test knob: seeded router bias that skews expert load")
    add_switch(p, "--enforce-eager", "no compiled decode graphs: every step runs eagerly")
    add(p, "--max-graph-batch", d.max_graph_batch, "largest decode batch the compiled graphs run")
    add(
        p,
        "--one-thread-below",
        d.one_thread_below,
        "eager steps of fewer new tokens run on one torch thread (0: all on every step)",
    )


def add_eplb_flags(p: argparse.ArgumentParser) -> None:
    d = EplbConfig()
    add(
        p,
        "--eplb-interval-steps",
        d.interval_steps,
        "rebalance every N group steps (0: on request)",
    )
    add(
        p,
        "--eplb-hash-interval-steps",
        d.hash_interval_steps,
        "rebalance hash-routed layers (DeepSeek-V4) every N group steps "
        "(-1: 10x --eplb-interval-steps; 0: on request)",
    )
    add(p, "--eplb-num-nodes", d.num_nodes, "nodes a group spans (hierarchical placement)")
    add(p, "--eplb-min-gain", d.min_gain, "apply a placement only if balancedness gains this much")
    add(p, "--eplb-poll", d.poll_s, "seconds between reads of the groups' expert load")


def eplb_config(args: argparse.Namespace) -> EplbConfig:
    return EplbConfig(
        service=service_config(args),
        interval_steps=args.eplb_interval_steps,
        hash_interval_steps=args.eplb_hash_interval_steps,
        num_nodes=args.eplb_num_nodes,
        min_gain=args.eplb_min_gain,
        poll_s=args.eplb_poll,
    )


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()
    add(p, "--routing-policy", d.routing_policy, "routing policy", choices=sorted(POLICIES))
    add(p, "--max-attempts", d.max_attempts, "tries per stage before a request fails")
    add(p, "--retry-backoff", d.retry_backoff_s, "first retry's backoff in seconds")
    add(p, "--refresh", d.refresh_s, "seconds between reads of the cluster state")
    add(
        p,
        "--migration-limit",
        d.migration_limit,
        "times a request whose worker fails after "
        "streaming may go on on another worker (0: it fails)",
    )


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    add(p, "--model", d.model, "preset or checkpoint directory (tokenizer, chat template)")
    add(p, "--served-model-name", d.served_model_name, "the name clients ask for (default: model)")
    add(
        p,
        "--scheduler",
        ",".join(d.schedulers),
        "the scheduler's gRPC address; replicas: "
        "several, comma-separated (each request goes to the least busy one that is up)",
    )
    add(
        p,
        "--scheduler-wait",
        d.scheduler_wait_s,
        "seconds a request waits for a scheduler when none answers (restarting) before 503",
    )
    add(
        p,
        "--migration-limit",
        d.migration_limit,
        "times a stream whose scheduler goes away "
        "after it streamed tokens goes on through another (0: it fails)",
    )
    add(
        p,
        "--reasoning-parser",
        d.reasoning_parser,
        "a reasoning model's thinking goes to reasoning_content: deepseek_r1 ('' : none)",
    )
    add(
        p,
        "--tool-call-parser",
        d.tool_call_parser,
        "the format tool_choice 'auto' reads "
        "calls in: deepseek_v3 or deepseek_v31 (DeepSeek-V3.1 and later)",
    )
    add(p, "--host", d.host, "HTTP bind address")
    add(p, "--port", d.port, "HTTP port of the OpenAI API")
    add(p, "--grpc-port", d.grpc_port, "port of the public gRPC API (-1: off, 0: any)")
    add_key_flags(p, "require `Authorization: Bearer KEY` on the API ('': no auth)")
    add(p, "--max-body-bytes", d.max_body_bytes, "larger request bodies are refused (413)")
    _add_keepalive(p)
    add_tls_flags(p)
    add_tracing_flags(p)
    add(p, "--log-level", "info", "log level", choices=["debug", "info", "warning", "error"])


def add_key_flags(p: argparse.ArgumentParser, what: str) -> None:
    """The API key: in an environment variable or a file of the user's alone, as a secret
    should be (a command line is readable by every user of the host)."""
    add(p, "--api-key", "", what)
    add(p, "--api-key-file", "", "a file holding the key (mode 600), instead of --api-key")
    add_switch(p, "--metrics-auth", "GET /metrics needs the key too")


def api_key(args: argparse.Namespace) -> str:
    """The key --api-key or --api-key-file gives; ValueError for both, or a file that other
    users can read or that holds no key."""
    if not args.api_key_file:
        return str(args.api_key)
    if args.api_key:
        raise ValueError("give --api-key or --api-key-file, not both")
    path = Path(args.api_key_file)
    try:
        mode, key = path.stat().st_mode, path.read_text().strip()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"--api-key-file {path} is readable by other users: chmod 600 it")
    if not key:
        raise ValueError(f"--api-key-file {path} is empty")
    return key


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        schedulers=_addresses(args.scheduler),
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=api_key(args),
        metrics_auth=args.metrics_auth,
        max_body_bytes=args.max_body_bytes,
        scheduler_wait_s=args.scheduler_wait,
        migration_limit=args.migration_limit,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
    )


def _addresses(given: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in given.split(",") if a.strip())


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        worker_id=args.worker_id,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        metrics_port=args.metrics_port,
        redis_url=args.redis_url,
        cluster=args.cluster,
        grace_s=args.grace,
        ttl_s=args.heartbeat_ttl,
        log_level=args.log_level,
    )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        router_skew=args.router_skew,
        enforce_eager=args.enforce_eager,
        max_graph_batch=args.max_graph_batch,
        one_thread_below=args.one_thread_below,
    )
    return WorkerConfig(
        service=service_config(args),
        engine=engine,
        kv_transport=args.kv_transport,
        kv_port=args.kv_port,
        lease_seconds=args.lease_seconds,
        transfer_timeout_s=args.transfer_timeout,
        verify_checksum=args.verify_checksum,
        kv_probe_interval_s=args.kv_probe_interval,
        torch_threads=args.torch_threads,
        nice=args.nice,
        dep_size=args.dep_size,
        dep_rank=args.dep_rank,
        dep_master=args.dep_master,
        dep_group=args.dep_group,
        num_redundant_experts=args.num_redundant_experts,
        dep_timeout_s=args.dep_timeout,
    )


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        service=service_config(args),
        routing_policy=args.routing_policy,
        max_attempts=args.max_attempts,
        retry_backoff_s=args.retry_backoff,
        refresh_s=args.refresh,
        migration_limit=args.migration_limit,
    )
