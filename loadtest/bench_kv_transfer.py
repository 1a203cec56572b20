"""KV transfer bandwidth and latency between two processes on this host, side by side.

For each layout (the `small` preset's cache, and DeepSeek-V3's: 61 layers x 576 values x bf16,
on a synthetic cache; or DeepSeek-V4.1-Flash's, bf16 or FP8, whose pulls also move the request's
state slot) and 1k / 8k / 32k tokens: one-shot GB/s over `ucx` and `grpc` (an exporter
process, this process importing), a local gather + scatter of the same blocks (the memory
bandwidth ceiling), and UCX's own `ucx_perftest -t tag_bw` at the same message size (the ceiling
of UCX itself; each one-shot ucx row records its share of it as "of_ucx_perftest"). Then p50/p99
latency of a 1k-token pull under 16 concurrent pulls.

    python loadtest/bench_kv_transfer.py            # writes loadtest/results/kv_transfer.json
    python loadtest/bench_kv_transfer.py --layouts deepseek-v4.1-flash,deepseek-v4.1-flash-fp8 \
        --out loadtest/results/kv_transfer-v41.json

A transport moves a block as one run of bytes whatever it holds, so V4.1's layouts are stood in
for by one group of as many bytes a block (its paged groups'), and each pull of t tokens moves
t / 64 blocks and the state slot's blocks (``CacheSpec.state_blocks``), as a hand-off does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import libucx
import torch
from harness import record, write_result

from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.engine.model.cache_spec import CacheSpec
from ferry.services.engine.model.full_size import DEEPSEEK_V41_FLASH
from ferry.services.engine.model.v41.kv_cache import v41_cache_spec
from ferry.services.engine.model.v41.quant import CacheFormat
from ferry.services.kv_transfer.endpoints import KvImporter
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint
from ferry.services.kv_transfer.staging import gather_blocks, scatter_blocks
from ferry.services.kv_transfer.transport import create_transport
from ferry.services.kv_transfer.ucx import UCX_DEFAULTS

BLOCK = 64


def _stand_in(spec: CacheSpec) -> tuple[int, int, str, int]:
    """A bf16 cache of ``spec``'s as (layers, dim, dtype, state blocks) of one group: the same
    bytes a block, and the blocks a request's state slot takes."""
    size = spec.bytes_per_block(BLOCK, 2)
    assert size % (BLOCK * 2) == 0, size
    return 1, size // (BLOCK * 2), "bfloat16", spec.state_blocks(BLOCK, 2)


# name -> (layers, dim, dtype, state blocks a pull moves besides its tokens')
LAYOUTS = {
    "small": (6, 160, "float32", 0),
    "deepseek-v3": (61, 576, "bfloat16", 0),
    "deepseek-v4.1-flash": _stand_in(v41_cache_spec(DEEPSEEK_V41_FLASH)),
    "deepseek-v4.1-flash-fp8": _stand_in(v41_cache_spec(DEEPSEEK_V41_FLASH, CacheFormat("fp8"))),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Block placement on both sides: "contiguous" ids (one run per transfer, as a fresh cache hands
# out) move in place; "scattered" (random ids on both sides) are staged and copied on both sides.
RUNS = [("ucx", "contiguous"), ("ucx", "scattered"), ("grpc", "contiguous")]


def exporter(
    transport: str, layers: int, dim: int, dtype: str, sizes: list[int], blocks: str
) -> tuple[subprocess.Popen[str], list[KvHandle]]:
    cmd = [
        sys.executable,
        "-m",
        "ferry.services.kv_transfer.synthetic_exporter",
        "--transport",
        transport,
        "--layers",
        str(layers),
        "--dim",
        str(dim),
        "--dtype",
        dtype,
        "--block-size",
        str(BLOCK),
        "--blocks",
        str(max(sizes)),
        "--reuse-blocks",
        "--lease-seconds",
        "600",
        "--sizes",
        ",".join(map(str, sizes)),
    ]
    if blocks == "contiguous":
        cmd.append("--contiguous")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, [KvHandle.from_json(json.dumps(h)) for h in info["handles"]]


async def measure(
    transport: str,
    blocks: str,
    layout: LayoutFingerprint,
    handles: list[KvHandle],
    tokens: list[int],
    repeats: int,
    concurrent: int,
    state: int,
) -> list[dict[str, object]]:
    n_max = max(tokens) // BLOCK + state
    (g,) = layout.groups
    cache = torch.zeros(g.num_layers, n_max, BLOCK, g.dim, dtype=DTYPES[layout.dtype])
    imp = KvImporter(
        create_transport(transport),
        cache,
        KVCacheManager(n_max, BLOCK),
        layout,
        transfer_timeout=600,
    )
    queue = list(handles)
    rows: list[dict[str, object]] = []
    perm = torch.randperm(n_max, generator=torch.Generator().manual_seed(7)).tolist()
    for t in tokens:
        n = t // BLOCK + state
        dst = list(range(n)) if blocks == "contiguous" else perm[:n]
        times = []
        for _ in range(repeats + 1):  # the first pull warms the connection and the buffers
            h = queue.pop(0)
            started = time.perf_counter()
            await imp.pull(h, dst)
            times.append(time.perf_counter() - started)
        nbytes = n * layout.block_bytes
        rows.append(
            {
                "transport": transport,
                "blocks": blocks,
                "tokens": t,
                "bytes": nbytes,
                "gbps": nbytes / statistics.median(times[1:]) / 1e9,
            }
        )
    if concurrent:
        rows.append(
            await _concurrent_latency(
                imp,
                queue,
                blocks,
                tokens[0] // BLOCK + state,
                n_max,
                perm,
                concurrent,
                tokens[0],
            )
        )
    await imp.transport.close()
    return rows


async def _concurrent_latency(
    imp: KvImporter,
    queue: list[KvHandle],
    blocks: str,
    n: int,
    n_max: int,
    perm: list[int],
    concurrent: int,
    tokens: int,
) -> dict[str, object]:
    """p50/p99 of ``n``-block pulls (``tokens`` and the state's), ``concurrent`` at a time, four
    rounds."""
    lat: list[float] = []
    for _ in range(4):

        async def one(h: KvHandle, dst: list[int]) -> None:
            started = time.perf_counter()
            await imp.pull(h, dst)
            lat.append(time.perf_counter() - started)

        batch = [queue.pop(0) for _ in range(concurrent)]
        if blocks == "contiguous":
            dsts = [[(i * n + j) % n_max for j in range(n)] for i in range(concurrent)]
        else:
            dsts = [[perm[(i * n + j) % n_max] for j in range(n)] for i in range(concurrent)]
        await asyncio.gather(*(one(h, d) for h, d in zip(batch, dsts, strict=True)))
    lat.sort()
    return {
        "transport": imp.transport.name,
        "blocks": blocks,
        "tokens": tokens,
        "blocks_per_pull": n,
        "concurrent": concurrent,
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
    }


def local_copy(
    layout: LayoutFingerprint, tokens: list[int], repeats: int, state: int
) -> list[dict[str, object]]:
    n_max = max(tokens) // BLOCK + state
    dtype = DTYPES[layout.dtype]
    (g,) = layout.groups
    src = torch.ones(g.num_layers, n_max, BLOCK, g.dim, dtype=dtype)
    dst = torch.zeros_like(src)
    rows: list[dict[str, object]] = []
    for t in tokens:
        n = t // BLOCK + state
        ids = list(range(n))
        buf = torch.empty(g.num_layers, n, BLOCK, g.dim, dtype=dtype)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            scatter_blocks(dst, ids, gather_blocks(src, ids, out=buf))
            times.append(time.perf_counter() - started)
        nbytes = n * layout.block_bytes
        rows.append(
            {
                "transport": "local",
                "tokens": t,
                "bytes": nbytes,
                "gbps": nbytes / statistics.median(times[1:]) / 1e9,
            }
        )
    return rows


def ucx_perftest(nbytes: int, port: int) -> float:
    """UCX's own tag_bw between two processes at one message size; GB/s."""
    root = Path(libucx.__file__).parent
    env = {
        **os.environ,
        **UCX_DEFAULTS,
        "LD_LIBRARY_PATH": f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    }
    iters = str(max(5, min(200, (4 << 30) // nbytes)))
    args = ["-p", str(port), "-t", "tag_bw", "-s", str(nbytes), "-n", iters]
    server = subprocess.Popen(
        [str(root / "bin" / "ucx_perftest"), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)
        out = subprocess.run(
            [str(root / "bin" / "ucx_perftest"), "127.0.0.1", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
    finally:
        server.kill()
        server.wait()
    final = next(line for line in out.splitlines() if line.startswith("Final:"))
    return float(final.split()[6]) * 2**20 / 1e9  # "overall" column, in MiB/s (UCS_MBYTE)


def of_perftest(rows: list[dict[str, object]]) -> None:
    """Add to each one-shot ucx row of one layout its share of ucx_perftest's GB/s at the same
    size ("of_ucx_perftest"), and print them."""
    ceiling = {r["tokens"]: r["gbps"] for r in rows if r["transport"] == "ucx_perftest"}
    for r in rows:
        if r["transport"] == "ucx" and "gbps" in r:
            gbps, perftest = float(r["gbps"]), float(ceiling[r["tokens"]])  # type: ignore[arg-type]
            r["of_ucx_perftest"] = gbps / perftest
            print(
                f"{r['layout']} {r['tokens']} tokens: ucx {r['blocks']} {gbps:.2f} GB/s, "
                f"{gbps / perftest:.0%} of ucx_perftest's {perftest:.2f}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--layouts", default="small,deepseek-v3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument(
        "--ucx-progress-mode",
        default=None,
        choices=["thread", "polling", "blocking"],
        help="ucxx progress mode of both processes (UCXPY_PROGRESS_MODE); default: Ferry's, ucx.UCX_DEFAULTS",
    )
    ap.add_argument(
        "--runs",
        default=",".join(f"{t}:{b}" for t, b in RUNS),
        help="transport:placement pairs to measure (default: all)",
    )
    ap.add_argument(
        "--no-ceilings",
        action="store_true",
        help="skip the local copy and ucx_perftest (for quick experiments)",
    )
    ap.add_argument("--out", default="loadtest/results/kv_transfer.json")
    args = ap.parse_args()
    if args.ucx_progress_mode:  # before ucxx is imported here, and inherited by the exporters
        os.environ["UCXPY_PROGRESS_MODE"] = args.ucx_progress_mode
    header = record(
        ucx_env=UCX_DEFAULTS,
        ucx_progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", "ucxx default (thread)"),
    )
    tokens = [int(t) for t in args.tokens.split(",")]
    results: list[dict[str, object]] = []
    for name in args.layouts.split(","):
        layers, dim, dtype, state = LAYOUTS[name]
        layout = LayoutFingerprint.latent("test-model", dtype, layers, dim, BLOCK)
        sizes = [t // BLOCK + state for t in tokens for _ in range(args.repeats + 1)] + [
            tokens[0] // BLOCK + state
        ] * (4 * args.concurrent)
        runs = [tuple(r.split(":")) for r in args.runs.split(",")]
        for transport, blocks in runs:
            proc, handles = exporter(transport, layers, dim, dtype, sizes, blocks)
            try:
                rows = asyncio.run(
                    measure(
                        transport,
                        blocks,
                        layout,
                        handles,
                        tokens,
                        args.repeats,
                        args.concurrent,
                        state,
                    )
                )
            finally:
                proc.kill()
                proc.wait()
            results += [{**r, "layout": name} for r in rows]
            print(f"{name} {transport} {blocks}: {rows}", flush=True)
        if args.no_ceilings:
            continue
        copies = local_copy(layout, tokens, args.repeats, state)
        results += [{**r, "layout": name} for r in copies]
        for t in tokens:
            nbytes = (t // BLOCK + state) * layout.block_bytes
            results.append(
                {
                    "transport": "ucx_perftest",
                    "layout": name,
                    "tokens": t,
                    "bytes": nbytes,
                    "gbps": ucx_perftest(nbytes, 13400 + t % 97),
                }
            )
        of_perftest([r for r in results if r["layout"] == name])
        print(json.dumps([r for r in results if r["layout"] == name], indent=1), flush=True)
    print(f"wrote {write_result(args.out, {**header, 'results': results})}")


if __name__ == "__main__":
    main()
