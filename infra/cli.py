"""The ``ferry`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.engine.model.presets import PRESETS

ROLES = ("gateway", "scheduler", "prefill", "decode", "eplb-controller")


def _export_preset(args: argparse.Namespace) -> int:
    from services.engine.model.loader import export_preset

    path = export_preset(args.name, args.dir, max_shard_bytes=args.max_shard_bytes)
    print(f"wrote preset {args.name!r} as a HF checkpoint in {path}")
    return 0


def _not_yet(args: argparse.Namespace) -> int:
    what = "ferry up" if args.command == "up" else f"ferry serve {args.role}"
    print(
        f"{what}: not yet — the services (gateway, scheduler, workers) are not built yet; "
        "today Ferry has the model runtime (services/engine/model) and `ferry export-preset`.",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry: disaggregated MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)

    exp = sub.add_parser("export-preset", help="write a seeded random preset as a HF checkpoint")
    exp.add_argument("name", choices=sorted(PRESETS))
    exp.add_argument("dir", help="output directory (created if missing)")
    exp.add_argument("--max-shard-bytes", type=int, default=None, help="shard the safetensors")
    exp.set_defaults(func=_export_preset)

    up = sub.add_parser("up", help="start a local cluster (redis + all services)")
    up.set_defaults(func=_not_yet)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=ROLES)
    serve.set_defaults(func=_not_yet)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
