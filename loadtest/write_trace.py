"""Write an AgentX-like trace (``agentx.py``'s sessions) as JSON lines, for Locust's
``--agentx-trace``, ``ferry simulate --trace`` or a replay of your own.

    python loadtest/write_trace.py --sessions 200 --out trace.jsonl
"""

from __future__ import annotations

import argparse
import json

from agentx import WorkloadConfig, generate_sessions, summary, write_trace


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Write an AgentX-like trace (JSON lines).", allow_abbrev=False
    )
    p.add_argument("--out", required=True, help="the trace file to write")
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context", type=int, default=4096, help="the model's max_model_len")
    args = p.parse_args(argv)
    config = WorkloadConfig(seed=args.seed, max_context_tokens=args.max_context)
    sessions = generate_sessions(config, 0, args.sessions)
    n = write_trace(args.out, config, sessions)
    print(f"wrote {n} requests of {len(sessions)} sessions to {args.out}")
    print(json.dumps(summary(sessions), indent=2))


if __name__ == "__main__":
    main()
