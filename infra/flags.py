"""Command-line flags of the services, each with a FERRY_* environment variable, and the
configs they build. This is the one place that reads FERRY_* variables for services.

A flag is declared once, as a :class:`Flag` in the table of the config it sets: that one line
gives the argument, its variable, its help with the default (the config field's) and the field
it fills in. A flag that sets no field (``option``) states its own default."""

from __future__ import annotations

import argparse
import dataclasses
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ferry.gateway.config import GatewayConfig
from ferry.services.common.channels import KEEPALIVE_S
from ferry.services.common.config import ServiceConfig
from ferry.services.common.tls import TlsFiles
from ferry.services.engine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from ferry.services.eplb_controller.config import EplbConfig
from ferry.services.kv_transfer.registry import transport_names
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.policies import POLICIES
from ferry.services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")

_TRUE = {"1", "true", "yes", "on"}
LOG_LEVELS = ["debug", "info", "warning", "error"]


class Parser(argparse.ArgumentParser):
    """Ferry's ArgumentParser: a flag is written out whole. argparse's abbreviations are off
    (with them ``ferry simulate --workload X`` was read as ``--workload-scale X``); the
    sub-commands' parsers are of this class too."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **{**kw, "allow_abbrev": False})


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: its argument, its FERRY_<FLAG> variable (which sets the default), its help
    with the default shown, and the config field it sets."""

    name: str  # "--max-num-seqs"
    help: str
    # the field of its table's config it sets: by default the one its words name
    # (--max-num-seqs: max_num_seqs), whose default is the flag's; None: no field
    field: str | None = ""
    default: Any = None  # None with a field: the field's
    type: Callable[[str], Any] | None = None  # None: the default's type, str for None
    choices: Sequence[Any] | None = None
    switch: bool = False  # off unless given, or FERRY_<FLAG> is 1, true, yes or on
    to_field: Callable[[Any], Any] | None = None  # the flag's value as the field takes it

    def __post_init__(self) -> None:
        if self.field == "":
            object.__setattr__(self, "field", self.dest)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def option(name: str, default: Any, help: str, **kw: Any) -> Flag:
    """A flag that sets no config field: the command reads it itself (or hands it on)."""
    return Flag(name, help, field=None, default=default, **kw)


def switch(name: str, help: str, field: str | None = "", **kw: Any) -> Flag:
    return Flag(name, help, field=field, switch=True, **kw)


class Flags(Generic[C]):
    """The flags that fill in one config, in the order ``--help`` lists them. A flag naming a
    field the config lacks fails here, when the module is imported."""

    def __init__(self, config: type[C], *flags: Flag) -> None:
        fields = {f.name: f for f in dataclasses.fields(config)}
        self.config = config
        self.flags: tuple[Flag, ...] = ()
        for flag in flags:
            if flag.field is not None and flag.field not in fields:
                raise TypeError(f"{flag.name}: {config.__name__} has no field {flag.field!r}")
            if flag.field is not None and flag.default is None and not flag.switch:
                flag = dataclasses.replace(flag, default=_default(fields[flag.field]))
            self.flags += (flag,)

    def __iter__(self) -> Iterator[Flag]:
        return iter(self.flags)

    def build(self, args: argparse.Namespace, **given: Any) -> C:
        """The config from parsed flags; ``given``: the fields no flag of this table sets (a
        nested config), or that several flags set together."""
        values = {}
        for flag in self.flags:
            if flag.field is not None:
                value = getattr(args, flag.dest)
                values[flag.field] = flag.to_field(value) if flag.to_field else value
        return self.config(**{**values, **given})


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def env_name(flag: str) -> str:
    return "FERRY_" + flag.lstrip("-").upper().replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, *tables: Iterable[Flag]) -> None:
    for table in tables:
        for flag in table:
            _add(parser, flag)


def _add(parser: argparse.ArgumentParser, flag: Flag) -> None:
    """``flag``, whose default comes from FERRY_<FLAG> when set."""
    env = env_name(flag.name)
    raw = os.environ.get(env)
    if flag.switch:
        on = (raw or "").lower() in _TRUE
        parser.add_argument(flag.name, action="store_true", default=on, help=f"{flag.help} [{env}]")
        return
    default = flag.default
    kind = flag.type or (type(default) if default is not None else str)
    # no value (None, ""): the help's own words say what that means ("default 1; 0 with ...")
    shown = env if default in (None, "") else f"{env}; {default}"
    parser.add_argument(
        flag.name,
        type=kind,
        default=kind(raw) if raw is not None else default,
        choices=flag.choices,
        help=f"{flag.help} [{shown}]",
    )


KEEPALIVE = option(
    "--keepalive",
    KEEPALIVE_S,
    "seconds between pings on each gRPC connection; a peer "
    "that does not answer within as long is taken for hung and its calls fail",
)
# Mutual TLS between the services (services/common/tls.py); all three or none.
TLS = (
    option("--tls-cert", "", "PEM certificate this process shows its peers (and HTTPS clients)"),
    option("--tls-key", "", "PEM private key of --tls-cert"),
    option("--tls-ca", "", "PEM CA that signs every peer's certificate"),
)


def tracing(trace_file: str = "") -> tuple[Flag, ...]:
    """OpenTelemetry spans of the requests (services/common/tracing.py); neither: none."""
    return (
        option("--otlp-endpoint", "", "send trace spans to this OTLP/gRPC collector (HOST:PORT)"),
        option(
            "--trace-file",
            "",
            trace_file
            or "append trace spans as JSON lines to this file (a directory, or a path ending in "
            "/: WORKER-ID.jsonl in it)",
        ),
    )


def tls_files(args: argparse.Namespace) -> TlsFiles:
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def api_key_flags(what: str, metrics_auth: str | None = "metrics_auth") -> tuple[Flag, ...]:
    """The API key: in an environment variable or a file of the user's alone, as a secret
    should be (a command line is readable by every user of the host). ``metrics_auth``: the
    field --metrics-auth sets (None: none)."""
    return (
        option("--api-key", "", what),
        option("--api-key-file", "", "a file holding the key (mode 600), instead of --api-key"),
        switch("--metrics-auth", "GET /metrics needs the key too", field=metrics_auth),
    )


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


def _addresses(given: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in given.split(",") if a.strip())


SERVICE = Flags(
    ServiceConfig,
    Flag("--worker-id", "unique name in the cluster (default: role-host-pid)"),
    Flag("--host", "gRPC bind address"),
    Flag("--port", "gRPC port (0: any free port)"),
    Flag("--advertise-host", "host that other services dial"),
    Flag("--metrics-port", "Prometheus /metrics port (0: any, -1: off)"),
    Flag("--redis-url", "Redis holding the cluster state"),
    Flag("--cluster", "cluster name (Redis key prefix)"),
    Flag("--grace", "seconds in-flight RPCs get on SIGTERM", field="grace_s"),
    Flag(
        "--heartbeat-ttl",
        "seconds a worker's registry record outlives its last heartbeat (it beats every "
        "TTL/3; a scheduler takes one whose record expired for hung)",
        field="ttl_s",
    ),
    KEEPALIVE,
    *TLS,
    *tracing(),
    Flag("--log-level", "log level", choices=LOG_LEVELS),
)

ENGINE = Flags(
    EngineConfig,
    Flag(
        "--model",
        "preset (tiny, small, v4-tiny, v4-small, v41-tiny, v41-small) or HF checkpoint directory",
    ),
    Flag(
        "--dtype",
        "weights and activations dtype (and the KV cache's, with auto)",
        choices=list(DTYPES),
    ),
    Flag(
        "--kv-cache-dtype",
        "KV cache storage: auto (--dtype) or fp8 (DeepSeek-V4.1: FP8 window, FP4 entries and keys)",
        choices=list(KV_CACHE_DTYPES),
    ),
    Flag(
        "--block-size",
        "tokens per KV block (default: the model's: 64, or a multiple of its compression ratios)",
        type=int,
    ),
    Flag("--num-kv-blocks", "KV cache size in blocks (default: from memory)", type=int),
    Flag("--kv-cache-memory-bytes", "KV cache budget in bytes", type=int),
    Flag("--max-num-seqs", "running requests per step"),
    Flag("--max-num-batched-tokens", "tokens per step"),
    Flag("--max-model-len", "context limit (default: the model's)", type=int),
    switch(
        "--no-prefix-caching",
        "turn the prefix cache off",
        field="enable_prefix_caching",
        to_field=operator.not_,
    ),
    Flag("--router-skew", "test knob: seeded router bias that skews expert load"),
    switch("--enforce-eager", "no compiled decode graphs: every step runs eagerly"),
    Flag("--max-graph-batch", "largest decode batch the compiled graphs run"),
    Flag(
        "--one-thread-below",
        "eager steps of fewer new tokens run on one torch thread (0: all on every step)",
    ),
)

WORKER = Flags(
    WorkerConfig,
    Flag("--kv-transport", "KV transfer transport", choices=transport_names()),
    Flag("--kv-port", "KV transport listener port (prefill; 0: any)"),
    Flag("--lease-seconds", "how long exported KV waits for its pull"),
    Flag("--transfer-timeout", "seconds a KV pull may take", field="transfer_timeout_s"),
    switch("--verify-checksum", "CRC32-check every KV transfer"),
    Flag(
        "--kv-probe-interval",
        "seconds between checks that the KV transport can still connect (0: none)",
        field="kv_probe_interval_s",
    ),
    Flag("--torch-threads", "torch intra-op threads (0: torch's default)"),
    Flag("--nice", "lower this worker's CPU priority by N (0..19): others go first"),
    Flag("--dep-size", "ranks in this worker's DEP group (1: none)"),
    Flag("--dep-rank", "this worker's rank in its DEP group"),
    Flag("--dep-master", "host:port where the group's ranks meet"),
    Flag("--dep-group", "the group's name in Redis (default: the master address)"),
    Flag("--num-redundant-experts", "extra expert slots per layer"),
    Flag("--dep-timeout", "seconds before a silent rank fails its group", field="dep_timeout_s"),
)

EPLB = Flags(
    EplbConfig,
    Flag(
        "--eplb-interval-steps",
        "rebalance every N group steps (0: on request)",
        field="interval_steps",
    ),
    Flag(
        "--eplb-hash-interval-steps",
        "rebalance hash-routed layers (DeepSeek-V4) every N group steps "
        "(-1: 10x --eplb-interval-steps; 0: on request)",
        field="hash_interval_steps",
    ),
    Flag("--eplb-num-nodes", "nodes a group spans (hierarchical placement)", field="num_nodes"),
    Flag(
        "--eplb-min-gain",
        "apply a placement only if balancedness gains this much",
        field="min_gain",
    ),
    Flag("--eplb-poll", "seconds between reads of the groups' expert load", field="poll_s"),
)

SCHEDULER = Flags(
    SchedulerConfig,
    Flag("--routing-policy", "routing policy", choices=sorted(POLICIES)),
    Flag("--max-attempts", "tries per stage before a request fails"),
    Flag("--retry-backoff", "first retry's backoff in seconds", field="retry_backoff_s"),
    Flag("--refresh", "seconds between reads of the cluster state", field="refresh_s"),
    Flag(
        "--migration-limit",
        "times a request whose worker fails after streaming may go on on another worker "
        "(0: it fails)",
    ),
)

GATEWAY = Flags(
    GatewayConfig,
    Flag("--model", "preset or checkpoint directory (tokenizer, chat template)"),
    Flag("--served-model-name", "the name clients ask for (default: model)"),
    Flag(
        "--scheduler",
        "the scheduler's gRPC address; replicas: several, comma-separated (each request goes "
        "to the least busy one that is up)",
        field="schedulers",
        default=",".join(GatewayConfig.schedulers),
        to_field=_addresses,
    ),
    Flag(
        "--scheduler-wait",
        "seconds a request waits for a scheduler when none answers (restarting) before 503",
        field="scheduler_wait_s",
    ),
    Flag(
        "--migration-limit",
        "times a stream whose scheduler goes away after it streamed tokens goes on through "
        "another (0: it fails)",
    ),
    Flag(
        "--reasoning-parser",
        "a reasoning model's thinking goes to reasoning_content: deepseek_r1 ('' : none)",
    ),
    Flag(
        "--tool-call-parser",
        "the format tool_choice 'auto' reads calls in: deepseek_v3 or deepseek_v31 "
        "(DeepSeek-V3.1 and later)",
    ),
    Flag("--host", "HTTP bind address"),
    Flag("--port", "HTTP port of the OpenAI API"),
    Flag("--grpc-port", "port of the public gRPC API (-1: off, 0: any)"),
    *api_key_flags("require `Authorization: Bearer KEY` on the API ('': no auth)"),
    Flag("--max-body-bytes", "larger request bodies are refused (413)"),
    KEEPALIVE,
    *TLS,
    *tracing(),
    option("--log-level", ServiceConfig.log_level, "log level", choices=LOG_LEVELS),
)

# `ferry serve ROLE`'s flags: the gateway's own; every other service's and its role's
ROLE_FLAGS: dict[str, tuple[Flags[Any], ...]] = {
    "gateway": (GATEWAY,),
    "scheduler": (SERVICE, SCHEDULER),
    "eplb": (SERVICE, EPLB),
    "prefill": (SERVICE, ENGINE, WORKER),
    "decode": (SERVICE, ENGINE, WORKER),
    "aggregated": (SERVICE, ENGINE, WORKER),
}


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return SERVICE.build(args)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GATEWAY.build(args, api_key=api_key(args))


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SCHEDULER.build(args, service=service_config(args))


def eplb_config(args: argparse.Namespace) -> EplbConfig:
    return EPLB.build(args, service=service_config(args))


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WORKER.build(args, service=service_config(args), engine=ENGINE.build(args))
