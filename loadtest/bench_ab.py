"""Two commits side by side: the engine's step times and throughput of this checkout against
``--base``, taking turns in one run, so that a refactor's "nothing slower" is a ratio measured
under the same load rather than two numbers from different hours.

Each turn is a child process that imports ``ferry`` from one tree (the base is a ``git
worktree`` in a temporary folder, put first on ``PYTHONPATH``) and measures, through the public
``Engine`` API only (so that any two commits compare):

- ``single_user_ms``: the median decode step of one request, 600-token prompt, 128 tokens, on
  the tiny preset (what ``bench_peer.py``'s single-user line measures for Ferry);
- ``step_ms_at_N``: the median decode step of ``--model`` with N requests running
  (``--batches``);
- ``output_tokens_per_s``: ``--requests`` requests of ``bench_engine.py``'s workload (prompts
  32..1024, outputs 16..512, seeded) through the same Engine (at most max(batches) running).

    python loadtest/bench_ab.py --base 58f44e2                 # -> results/ab-58f44e2.json
    python loadtest/bench_ab.py --base HEAD~3 --rounds 5 --model v4-small
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, record, write_result


def measure(model: str, batches: list[int], requests: int, threads: int) -> dict[str, Any]:
    """One turn, in a child process: imports whichever ``ferry`` is first on the path."""
    import torch

    from ferry.services.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(threads)

    def engine(max_seqs: int, name: str = model) -> Engine:
        return Engine(
            EngineConfig(
                model=name,
                dtype="float32",
                block_size=64,
                max_num_seqs=max_seqs,
                max_num_batched_tokens=2048,
                kv_cache_memory_bytes=1 << 30,
            )
        )

    def median_decode_ms(eng: Engine, prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
        steps = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            s = eng.last_step
            if s is not None and s.num_tokens == s.num_seqs == len(prompts):
                steps.append(time.perf_counter() - t)
        return statistics.median(steps) * 1e3

    gen = torch.Generator().manual_seed(0)
    base = torch.randint(1, 250, (600,), generator=gen).tolist()
    out: dict[str, Any] = {}
    eng = engine(1, "tiny")
    median_decode_ms(eng, [base], 16)  # warm-up
    out["single_user_ms"] = median_decode_ms(eng, [[256, *base[1:]]], 128)
    eng = engine(max(batches))
    for b in batches:
        prompts = [[*base[:100], 7 + i] for i in range(b)]
        median_decode_ms(eng, prompts, 8)  # warm-up for this batch
        out[f"step_ms_at_{b}"] = median_decode_ms(eng, [[*p, 3] for p in prompts], 64)
    reqs = []
    for _ in range(requests):
        p_len = int(torch.randint(32, 1025, (1,), generator=gen))
        o_len = int(torch.randint(16, 513, (1,), generator=gen))
        reqs.append((torch.randint(0, 256, (p_len,), generator=gen).tolist(), o_len))
    t = time.perf_counter()
    outs = eng.generate(
        [p for p, _ in reqs],
        [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs],
    )
    tokens = sum(len(o.token_ids) for o in outs)
    out["output_tokens_per_s"] = tokens / (time.perf_counter() - t)
    return out


def turn(tree: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if tree is not None:  # a folder whose ``ferry`` links to the base worktree, first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    spec = json.dumps([args.model, args.batches, args.requests, args.threads])
    here = str(Path(__file__).parent)
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); from bench_ab import measure; "
        f"print('RESULT', json.dumps(measure(*json.loads({spec!r}))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"turn failed ({tree or 'this checkout'}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--model", default="small", help="the batched and throughput runs' model")
    ap.add_argument("--batches", default="8,64", help="decode batch sizes to time")
    ap.add_argument("--requests", type=int, default=64, help="requests in the throughput run")
    ap.add_argument("--rounds", type=int, default=3, help="turns per tree, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: results/ab-BASE.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the worktree goes too
    header = record(threads=args.threads)
    base = subprocess.check_output(["git", "rev-parse", "--short", args.base], cwd=ROOT, text=True)
    base = base.strip()
    runs: dict[str, list[dict[str, Any]]] = {"head": [], "base": []}
    with tempfile.TemporaryDirectory(prefix="ferry-ab-") as tmp:
        worktree, view = Path(tmp) / "tree", Path(tmp) / "view"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            view.mkdir()
            (view / "ferry").symlink_to(worktree)
            for r in range(args.rounds):
                for name, tree in (
                    (("base", view), ("head", None)) if r % 2 else (("head", None), ("base", view))
                ):
                    runs[name].append(turn(tree, args))
                    print(f"round {r} {name}: {runs[name][-1]}", flush=True)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(worktree)],
                cwd=ROOT,
                check=False,
                capture_output=True,
            )
    medians = {
        name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
        for name, rs in runs.items()
    }
    ratio = {k: medians["head"][k] / medians["base"][k] for k in medians["head"]}
    result = {
        **header,
        "base": base,
        "workload": {"model": args.model, "batches": args.batches, "requests": args.requests},
        "runs": runs,
        "median": medians,
        "head_over_base": ratio,
        "reading": "ms: below 1 is faster; output_tokens_per_s: above 1 is faster",
    }
    out = Path(args.out or ROOT / "loadtest" / "results" / f"ab-{base}.json")
    write_result(out, result)
    print(json.dumps(ratio, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
