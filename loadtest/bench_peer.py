"""Ferry against llama.cpp's ``llama-server`` on the same weights, side by side (issue 31).

    make bench-peer                         # → loadtest/results/peer-llamacpp.json, peer-llamacpp.png
    python loadtest/bench_peer.py --duration 20 --concurrency 1,8

1. llama-server built from source and the ``tiny`` preset converted to an f32 GGUF
   (``llamacpp.py``; both kept under build/peer).
2. The logits match: greedy tokens and top-5 logprobs of 32 tokens after a 40-token prompt, from
   llama-server (flash attention off) and from Ferry's engine (compiled decode, the default),
   position by position.
3. One user in-process: a 600-token prompt then 128 greedy tokens, ms per token. Ferry: its
   engine's decode steps (2 torch threads). llama.cpp: ``timings.predicted_per_token_ms`` of
   llama-server's ``/completion`` (``-t 2``), the time of its own decode loop. Five rounds each,
   taking turns.
4. Served: the project's AgentX-like workload (``agentx.py``, as ``bench-serve`` plays it) as
   streaming ``/v1/completions`` (the same prompt text to both) at each concurrency, against
   ``ferry up`` with its defaults (1 prefill + 1 decode worker) and against
   ``llama-server -np 32 -t 2``. One server at a time on this machine.

EOS: llama.cpp's ``ignore_eos`` bans EOS; Ferry's lets it be sampled and goes on. Every request
asks for exactly its output length either way, so both produce the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch
from agentx import WorkloadConfig, generate_sessions, summary, write_trace
from engine_steps import decode_steps
from harness import CONFIGS, ClusterConfig, ferry_up, record, warm_up, write_result
from levels import Server, level_stats, plan_levels, run_locust
from llamacpp import build_server, convert, llama_server, say

from ferry.services.engine import Engine, EngineConfig, SamplingParams

HERE = Path(__file__).resolve().parent
# ggml's threads spin for a while after each request (llama-server's --poll): each side starts
# only once the other has been idle this long
IDLE_S = 2.0
PEER = ClusterConfig("llamacpp", "llama-server -np 32 -t 2 -fa off", ())


def check_logits(url: str, engine: Engine, tokens: int = 32) -> dict[str, Any]:
    """Greedy tokens and top-5 logprobs from both on the same ids (BOS first). llama-server
    merges the probabilities of tokens that end inside a UTF-8 character into the next one's
    entry, so it is asked for one token at a time along Ferry's greedy path; where that token
    is such a byte it says nothing, and the position is skipped."""
    gen = torch.Generator().manual_seed(1)
    prompt = [256, *torch.randint(32, 127, (40,), generator=gen).tolist()]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    ours = engine.generate([prompt], params)[0]
    diffs, same, positions = [], 0, 0
    for i, mine in enumerate(ours.logprobs or []):
        body = {"prompt": prompt + ours.token_ids[:i], "n_predict": 1, "temperature": 0}
        body |= {"n_probs": 5, "ignore_eos": True, "cache_prompt": False}
        reply = requests.post(f"{url}/completion", json=body, timeout=60).json()
        if not reply.get("completion_probabilities"):
            continue
        step = reply["completion_probabilities"][0]
        positions += 1
        same += step["id"] == ours.token_ids[i]
        diffs += [
            abs(mine[c["id"]] - c["logprob"]) for c in step["top_logprobs"] if c["id"] in mine
        ]
    return {
        "positions": tokens,
        "positions_compared": positions,
        "same_greedy_token": same,
        "logprobs_compared": len(diffs),
        "max_abs_logprob_diff": max(diffs, default=float("nan")),
    }


def ferry_ms_per_token(engine: Engine, prompt: list[int], tokens: int) -> float:
    return statistics.median(total for total, _ in decode_steps(engine, prompt, tokens)) * 1e3


def llama_ms_per_token(url: str, prompt: list[int], tokens: int) -> float:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True}
    body |= {"cache_prompt": False}
    reply = requests.post(f"{url}/completion", json=body, timeout=300).json()
    return float(reply["timings"]["predicted_per_token_ms"])


def single_user(url: str, engine: Engine, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(1, 250, (600,), generator=gen).tolist()
    ferry, llama = [], []
    ferry_ms_per_token(engine, base, 16)  # warm-up
    llama_ms_per_token(url, base, 16)
    for r in range(rounds):
        prompt = [256] + [(t + r) % 249 + 1 for t in base[1:]]
        time.sleep(IDLE_S)
        ferry.append(ferry_ms_per_token(engine, prompt, 128))
        time.sleep(IDLE_S)
        llama.append(llama_ms_per_token(url, prompt, 128))
    return {
        "prompt_tokens": 600,
        "output_tokens": 128,
        "ferry_ms_per_token": ferry,
        "llamacpp_ms_per_token": llama,
        "ferry_median": statistics.median(ferry),
        "llamacpp_median": statistics.median(llama),
        "ratio": statistics.median(ferry) / statistics.median(llama),
    }


def served(
    server: Server, args: argparse.Namespace, trace: Path, work_dir: Path
) -> list[dict[str, Any]]:
    """The AgentX-like sessions at each level as streaming completions (the prompt text)."""
    rows = []
    for level in plan_levels(args.levels, args.duration):
        log = run_locust(
            server,
            level,
            trace,
            duration_s=args.duration,
            model="tiny",
            api="completions",
            work_dir=work_dir,
        )
        reqs = [r for r in log if "summary" not in r]
        row = {"concurrency": level.concurrency, **level_stats(reqs, 1, 2.0, 0.05)}
        say(f"{server.name} c={level.concurrency}: {_brief(row)}")
        rows.append(row)
    return rows


def _brief(row: dict[str, Any]) -> str:
    if "ttft_s" not in row:
        return f"{row['requests']} requests, all failed"
    return (
        f"{row['requests']} requests ({row['failed']} failed), "
        f"{row['output_tokens_per_s']:.0f} tok/s, TPOT p50 {row['tpot_s']['p50'] * 1e3:.1f} ms, "
        f"TTFT p99 {row['ttft_s']['p99']:.2f} s"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, rows in result["served"].items():
        ok = [r for r in rows if "ttft_s" in r]
        c = [r["concurrency"] for r in ok]
        axes[0].plot(c, [r["output_tokens_per_s"] for r in ok], "o-", label=name)
        axes[1].plot(c, [r["tpot_s"]["p50"] * 1e3 for r in ok], "o-", label=name)
        axes[2].plot(c, [r["ttft_s"]["p99"] for r in ok], "o-", label=name)
    titles = ("output tokens/s", "TPOT p50 (ms)", "TTFT p99 (s)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    single = result["single_user"]
    fig.suptitle(
        f"tiny preset, same weights, 2 CPUs: one user in-process "
        f"{single['ferry_median']:.2f} ms/token (Ferry) vs {single['llamacpp_median']:.2f} "
        "(llama.cpp)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    s = result["single_user"]
    lines = [
        "| | Ferry | llama.cpp `llama-server` |",
        "|---|---|---|",
        f"| in-process decode, one request (600-token prompt), ms per token "
        f"| {s['ferry_median']:.2f} | {s['llamacpp_median']:.2f} |",
    ]
    llama = result["served"]["llamacpp"]
    for name, rows in result["served"].items():
        if not name.startswith("ferry"):
            continue
        flags = f" (`ferry up {result['ferry']['variants'][name[6:]]}`)" if name != "ferry" else ""
        for mine, theirs in zip(rows, llama, strict=True):
            if "ttft_s" not in mine or "ttft_s" not in theirs:
                continue
            lines.append(
                f"| served{flags}, {mine['concurrency']} concurrent sessions: output tok/s "
                f"(TPOT p50, TTFT p99) | {_cell(mine)} | {_cell(theirs)} |"
            )
    return "\n".join(lines)


def _cell(row: dict[str, Any]) -> str:
    return (
        f"{row['output_tokens_per_s']:.0f} ({row['tpot_s']['p50'] * 1e3:.1f} ms, "
        f"{row['ttft_s']['p99']:.2f} s)"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--concurrency", default="1,8,32", help="live sessions per level")
    p.add_argument("--duration", type=int, default=30, help="seconds per level")
    p.add_argument("--rounds", type=int, default=5, help="single-user rounds, taking turns")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp -t, Ferry's torch threads")
    p.add_argument("--out", default=str(HERE / "results" / "peer-llamacpp.json"))
    p.add_argument("--work-dir", default="", help="keep traces, Locust CSVs and logs here")
    p.add_argument("--table", action="store_true", help="print --out's JSON as a markdown table")
    p.add_argument(
        "--single-user-only", action="store_true", help="the logits and one user; print, no file"
    )
    p.add_argument(
        "--ferry-variants",
        default="",
        help='after the defaults, `ferry up` with other flags too: "NAME=FLAGS;NAME=FLAGS"',
    )
    args = p.parse_args()
    out = Path(args.out)
    if args.table:
        print(table(json.loads(out.read_text())))
        return
    args.levels = [int(c) for c in args.concurrency.split(",")]
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="ferry-peer-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    binary = build_server()
    ckpt, gguf = convert("tiny")
    result: dict[str, Any] = {
        **record(),
        "llamacpp": {
            "source": "llama-cpp-python 0.3.36 sdist (vendored llama.cpp)",
            "commit": _commit(binary),
            "server_flags": PEER.description,
            "gguf": "f32, converted by convert_hf_to_gguf.py",
        },
        "ferry": {
            "served": "ferry up (defaults: 1 prefill worker on every core, 1 decode worker on "
            "1 thread at nice 19)"
        },
        "eos": "llama.cpp's ignore_eos bans EOS; Ferry's samples it and goes on (same lengths)",
    }
    engine = Engine(EngineConfig(model=str(ckpt)), log=say)
    with llama_server(binary, gguf, args.threads, 1, 4096, work_dir / "llama-1.log") as url:
        result["logits"] = check_logits(url, engine)
        say(f"logits: {result['logits']}")
        result["single_user"] = single_user(url, engine, args.rounds)
        say(f"single user: {result['single_user']}")
    del engine
    if args.single_user_only:
        print(json.dumps(result, indent=2))
        return

    levels = plan_levels(args.levels, args.duration)
    workload = WorkloadConfig(seed=0, max_context_tokens=4096)
    sessions = generate_sessions(workload, 0, levels[-1].sessions[1])
    trace = work_dir / "agentx-trace.jsonl"
    write_trace(trace, workload, sessions)
    result["workload"] = {"generator": "loadtest/agentx.py", "shape": summary(sessions)}
    result["duration_s"] = args.duration
    result["served"] = {}
    slots = max(args.levels)
    with llama_server(binary, gguf, args.threads, slots, 4096, work_dir / "llama.log") as url:
        result["served"]["llamacpp"] = served(Server(PEER.name, url), args, trace, work_dir)
    with ferry_up(CONFIGS["1p1d"], "tiny", work_dir) as cluster:
        result["ferry"]["ready_s"] = cluster.ready_s
        warm_up(cluster, "tiny", 2)
        server = Server(cluster.config.name, cluster.http, cluster.grpc)
        result["served"]["ferry"] = served(server, args, trace, work_dir)
    for name, flags in variants(args.ferry_variants).items():
        config = ClusterConfig(name, flags, (*CONFIGS["1p1d"].args, *shlex.split(flags)))
        with ferry_up(config, "tiny", work_dir) as cluster:
            warm_up(cluster, "tiny", 2)
            server = Server(cluster.config.name, cluster.http, cluster.grpc)
            result["served"][f"ferry {name}"] = served(server, args, trace, work_dir)
        result["ferry"].setdefault("variants", {})[name] = flags
    write_result(out, result)
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print(f"wrote {out} and {out.with_suffix('.png')} (logs: {work_dir})")


def variants(spec: str) -> dict[str, str]:
    """``NAME=FLAGS;NAME=FLAGS`` → {name: `ferry up` flags}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, flags = part.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--ferry-variants: {part!r} is not NAME=FLAGS")
        out[name.strip()] = flags.strip()
    return out


def _commit(binary: Path) -> str:
    run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    return (run.stdout + run.stderr).strip().splitlines()[0] if run.returncode == 0 else ""


if __name__ == "__main__":
    main()
