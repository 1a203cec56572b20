"""A KV exporter in its own process over a synthetic cache, for transfer tests and benchmarks.

    python -m services.kv_transfer.synthetic_exporter --transport ucx --sizes 16,128,512

Builds a seeded latent cache, leases blocks for each requested size, serves them over the chosen
transport and prints one JSON line: {"handles": [...], "src_blocks": [[...], ...]}. It runs
until its stdin closes (so a parent that exits never leaves it behind) or it is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import torch

from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.kv_transfer.endpoints import KvExporter
from ferry.services.kv_transfer.handle import LayoutFingerprint
from ferry.services.kv_transfer.transport import create_transport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_cache(
    layers: int, blocks: int, block_size: int, dim: int, seed: int, dtype: str = "float32"
) -> torch.Tensor:
    """Seeded random values (the same in every process for the same arguments)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.empty(layers, blocks, block_size, dim, dtype=DTYPES[dtype])
    for layer in range(layers):  # layer by layer: no float32 copy of a large bf16 cache
        cache[layer] = torch.randn(blocks, block_size, dim, generator=gen)
    return cache


def layout(args: argparse.Namespace, model: str = "test-model") -> LayoutFingerprint:
    return LayoutFingerprint.latent(model, args.dtype, args.layers, args.dim, args.block_size)


async def main(args: argparse.Namespace) -> None:
    cache = make_cache(args.layers, args.blocks, args.block_size, args.dim, args.seed, args.dtype)
    kv = KVCacheManager(args.blocks, args.block_size)
    exporter = KvExporter(
        cache, kv, layout(args), worker_id="prefill-test", lease_seconds=args.lease_seconds
    )
    transport = create_transport(args.transport)
    transport.fault_delay_before_payload_s = args.fault_delay
    port = await transport.serve(exporter)
    perm = torch.randperm(
        args.blocks, generator=torch.Generator().manual_seed(args.seed + 1)
    ).tolist()
    handles, srcs = [], []
    next_free = 0
    for i, n in enumerate(int(s) for s in args.sizes.split(",")):
        # as a prefill would: a request holds the blocks, the lease pins them, the request ends
        if args.contiguous:  # consecutive block ids: sent in place, without a gather
            src = list(range(n)) if args.reuse_blocks else list(range(next_free, next_free + n))
            next_free += 0 if args.reuse_blocks else n
        elif args.reuse_blocks:  # benchmarks: every lease over the same blocks
            src = perm[:n]
        else:
            src, perm = perm[:n], perm[n:]
        kv.hold(f"request-{i}", src)
        handle = exporter.export(src, n * args.block_size, "127.0.0.1", port, args.transport)
        kv.release_hold(f"request-{i}")
        handles.append(json.loads(handle.to_json()))
        srcs.append(src)
    print(json.dumps({"handles": handles, "src_blocks": srcs}), flush=True)
    reaper = asyncio.create_task(exporter.run_reaper(0.1))
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    reaper.cancel()
    await transport.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--transport", default="ucx")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dim", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sizes", default="4")
    ap.add_argument("--lease-seconds", type=float, default=30.0)
    ap.add_argument("--fault-delay", type=float, default=0.0, help="stall before payloads (tests)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--contiguous", action="store_true", help="lease runs of consecutive blocks")
    ap.add_argument("--reuse-blocks", action="store_true", help="lease the same blocks repeatedly")
    asyncio.run(main(ap.parse_args()))
