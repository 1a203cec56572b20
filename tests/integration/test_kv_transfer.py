"""KV transfer between two real processes over UCX on 127.0.0.1, and leases in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import pytest
import torch

from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.kv_transfer import metrics
from ferry.services.kv_transfer.endpoints import KvExporter, KvImporter
from ferry.services.kv_transfer.handle import (
    KvHandle,
    LayoutFingerprint,
    LayoutMismatch,
    LeaseNotFound,
    TransferError,
)
from ferry.services.kv_transfer.staging import CHUNK_BYTES, WINDOW, block_runs
from ferry.services.kv_transfer.synthetic_exporter import make_cache
from ferry.services.kv_transfer.transport import create_transport
from ferry.services.kv_transfer.ucx import UcxTransport
from tests.waits import wait_until_async

LAYERS, BLOCKS, BS, DIM, SEED = 4, 1024, 16, 80, 1
LAYOUT = LayoutFingerprint.latent("test-model", "float32", LAYERS, DIM, BS)


@contextmanager
def exporter_process(
    *args: str,
) -> Iterator[tuple[subprocess.Popen[str], list[KvHandle], list[list[int]]]]:
    cmd = [
        sys.executable,
        "-m",
        "ferry.services.kv_transfer.synthetic_exporter",
        "--layers",
        str(LAYERS),
        "--blocks",
        str(BLOCKS),
        "--block-size",
        str(BS),
        "--dim",
        str(DIM),
        "--seed",
        str(SEED),
        *args,
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "exporter process exited before printing its handles"
        info = json.loads(line)
        handles = [KvHandle.from_json(json.dumps(h)) for h in info["handles"]]
        yield proc, handles, info["src_blocks"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def importer(transport: str, transfer_timeout: float = 10.0) -> KvImporter:
    cache = torch.zeros(LAYERS, BLOCKS, BS, DIM)
    kv = KVCacheManager(BLOCKS, BS)
    return KvImporter(
        create_transport(transport), cache, kv, LAYOUT, transfer_timeout, verify_checksum=True
    )


NETWORK = pytest.mark.parametrize("transport", ["ucx", "grpc"])


@NETWORK
def test_64_concurrent_pulls_arrive_bit_exact(transport: str) -> None:
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 13, (64,), generator=gen).tolist()
    expected = make_cache(LAYERS, BLOCKS, BS, DIM, SEED)
    with exporter_process("--transport", transport, "--sizes", ",".join(map(str, sizes))) as (
        _,
        handles,
        srcs,
    ):
        imp = importer(transport)
        perm = torch.randperm(BLOCKS, generator=gen).tolist()
        dsts = []
        for n in sizes:
            dsts.append(perm[:n])
            perm = perm[n:]

        async def run() -> None:
            await asyncio.gather(*(imp.pull(h, d) for h, d in zip(handles, dsts, strict=True)))
            await imp.transport.close()

        asyncio.run(run())
        for src, dst in zip(srcs, dsts, strict=True):
            assert torch.equal(imp.cache[:, dst], expected[:, src])
        # released leases cannot be pulled again
        with pytest.raises(LeaseNotFound):
            asyncio.run(_pull_once(importer(transport), handles[0]))


async def _pull_once(imp: KvImporter, handle: KvHandle, dst: list[int] | None = None) -> list[int]:
    try:
        return await imp.pull(handle, dst)
    finally:
        await imp.transport.close()


@NETWORK
def test_exporter_killed_mid_transfer(transport: str) -> None:
    # 512 blocks: more than one gRPC chunk, so the exporter stalls after the first one
    args = ("--transport", transport, "--sizes", "512", "--fault-delay", "30")
    with exporter_process(*args) as (proc, handles, _):
        imp = importer(transport, transfer_timeout=3.0)

        # (killed, it would have sent its first chunk, then waited 30 s)
        assert asyncio.run(_kill_mid_pull(imp, proc, handles[0], in_use=1)) < 4.0
        assert imp.kv.usage()["in_use"] == 0  # the reserved destination blocks are free again
        imp.kv.check_integrity()


async def _kill_mid_pull(
    imp: KvImporter, proc: Any, handle: KvHandle, in_use: int, grace: float = 0.0
) -> float:
    """Start ``imp``'s pull of ``handle``, kill the exporter once ``in_use`` blocks are held
    (its destination: the pull is under way) and ``grace`` more seconds have passed (for its
    header); the pull must fail naming the transfer. Returns the seconds it took to fail."""
    task = asyncio.create_task(imp.pull(handle))
    held = lambda: imp.kv.usage()["in_use"] >= in_use  # noqa: E731
    await wait_until_async("the pull's blocks held", held, 30, 0.01, explain=lambda: task)
    await asyncio.sleep(grace)
    os.kill(proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TransferError) as info:
        await task
    assert handle.transfer_id in str(info.value)
    await imp.transport.close()
    return time.monotonic() - started


def test_ucx_exporter_killed_during_a_chunked_pull() -> None:
    """Both sides fragmented, the exporter killed after announcing its chunks (it stalls before
    the first): the pull fails within its timeout and its destination blocks are free again."""
    args = ("--transport", "ucx", "--sizes", "512", "--fault-delay", "30")
    with exporter_process(*args) as (proc, handles, _):
        imp = importer("ucx", transfer_timeout=3.0)
        # hold every block, then free every other one: the pull's blocks are all apart
        taken = [imp.kv.hold_new(f"pad-{i}", 1) for i in range(BLOCKS)]
        for i in range(0, BLOCKS, 2):
            imp.kv.release_hold(f"pad-{i}")
        free = {b for blocks in taken[::2] for b in blocks or []}
        assert len(free) == 512 and not any(b + 1 in free for b in free)

        assert asyncio.run(_kill_mid_pull(imp, proc, handles[0], in_use=BLOCKS, grace=0.5)) < 4.0
        assert imp.kv.usage()["in_use"] == BLOCKS // 2  # only the padding is still held
        assert len(imp.staging) == 0  # the failed pull's buffers are not reused
        imp.kv.check_integrity()


def _result(stdout: IO[str]) -> str:
    """The next line a child process printed after "RESULT " (UCX and the logs print there too)."""
    while line := stdout.readline():
        if line.startswith("RESULT "):
            return line.removeprefix("RESULT ").rstrip("\n")
    raise AssertionError("the child process exited without its result")


# A second process that pulls the handles it reads from stdin, one after another, until killed.
PULL_FOREVER = """
import asyncio, sys, torch
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.kv_transfer.endpoints import KvImporter
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint
from ferry.services.kv_transfer.transport import create_transport
layers, blocks, bs, dim = map(int, sys.argv[1:5])
layout = LayoutFingerprint.latent("test-model", "float32", layers, dim, bs)
handles = [KvHandle.from_json(line) for line in sys.stdin]
imp = KvImporter(create_transport("ucx"), torch.zeros(layers, blocks, bs, dim),
                 KVCacheManager(blocks, bs), layout, 10.0)
async def main():
    for h in handles:
        await imp.pull(h)
        imp.kv.release_hold(imp.hold_key(h))
        print("RESULT pulled", flush=True)
asyncio.run(main())
"""


# An importer that outlives its exporter: it pulls the first handle into every block and checks
# the bytes, says so, then pulls the rest until the exporter is killed under it, and reports.
SURVIVE_EXPORTER = """
import asyncio, json, sys, time, torch
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.kv_transfer.endpoints import KvImporter
from ferry.services.kv_transfer.handle import KvHandle, LayoutFingerprint, TransferError
from ferry.services.kv_transfer.transport import create_transport
from ferry.services.kv_transfer.synthetic_exporter import make_cache
layers, blocks, bs, dim, seed = map(int, sys.argv[1:6])
lines = sys.stdin.read().splitlines()
src, handles = json.loads(lines[0]), [KvHandle.from_json(line) for line in lines[1:]]
cache = torch.zeros(layers, blocks, bs, dim)
imp = KvImporter(create_transport("ucx"), cache, KVCacheManager(blocks, bs),
                 LayoutFingerprint.latent("test-model", "float32", layers, dim, bs), 10.0, verify_checksum=True)
async def main():
    await imp.pull(handles[0], list(range(blocks)))
    exact = torch.equal(cache, make_cache(layers, blocks, bs, dim, seed)[:, src])
    print("RESULT", json.dumps({"bit_exact": exact}), flush=True)
    started, error = time.monotonic(), ""
    try:
        for h in handles[1:]:
            await imp.pull(h, None)
            imp.kv.release_hold(imp.hold_key(h))
    except TransferError as e:
        error = type(e).__name__
    seconds = time.monotonic() - started
    await imp.transport.close()
    imp.kv.check_integrity()
    print("RESULT", json.dumps({"error": error, "seconds": seconds, "in_use": imp.kv.usage()["in_use"]}))
asyncio.run(main())
"""


def test_ucx_peers_killed_while_bytes_move() -> None:
    """Shared-memory transfers keep UCX's peer failure handling: an importer killed mid-pull
    leaves the exporter serving, and an exporter killed mid-pull fails that pull (in the importer,
    which survives) with every destination block free again.

    Both importers are child processes: a peer killed in the middle of a shared-memory transfer
    can leave the survivor's UCX worker unable to reach new peers (see ucx.UCX_DEFAULTS), and
    this process goes on to test other transfers."""
    args = [
        "--transport",
        "ucx",
        "--dim",
        str(WIDE_DIM),
        "--blocks",
        str(WIDE_BLOCKS),
        "--sizes",
        ",".join(["256"] * 400),
        "--contiguous",
        "--reuse-blocks",
    ]
    shape = [str(x) for x in (LAYERS, WIDE_BLOCKS, BS, WIDE_DIM)]
    with exporter_process(*args) as (proc, handles, srcs):
        child = subprocess.Popen(
            [sys.executable, "-c", PULL_FOREVER, *shape],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("".join(h.to_json() + "\n" for h in handles[:300]))
        child.stdin.close()
        # it is pulling: kill it between two of its 64 MB transfers or inside one
        for _ in range(5):
            assert _result(child.stdout) == "pulled"
        child.kill()
        child.wait(10)
        assert proc.poll() is None, "the exporter died with its importer"

        survivor = subprocess.Popen(
            [sys.executable, "-c", SURVIVE_EXPORTER, *shape, str(SEED)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert survivor.stdin is not None and survivor.stdout is not None
            survivor.stdin.write(json.dumps(srcs[300]) + "\n")
            survivor.stdin.write("".join(h.to_json() + "\n" for h in handles[300:]))
            survivor.stdin.close()
            # the exporter still serves, bit-exact
            assert json.loads(_result(survivor.stdout)) == {"bit_exact": True}
            os.kill(proc.pid, signal.SIGKILL)  # it pulls the rest one after another meanwhile
            report = json.loads(_result(survivor.stdout))
            assert survivor.wait(10) == 0
        finally:
            if survivor.poll() is None:
                survivor.kill()
                survivor.wait(10)
    assert report["error"] == "TransferError"
    assert report["seconds"] < 10.0
    assert report["in_use"] == 0


# Wide blocks (64 KiB per layer), so that 16 consecutive blocks make a run that moves in place.
WIDE_DIM, WIDE_BLOCKS = 1024, 256
WIDE = LayoutFingerprint.latent("test-model", "float32", LAYERS, WIDE_DIM, BS)


@pytest.mark.parametrize("src", ["contiguous", "fragmented"])
def test_ucx_in_place_and_staged_sides_arrive_bit_exact(src: str) -> None:
    """Each side moves blocks in place when its ids make long runs, and stages them otherwise;
    every combination lands the same bytes, and an in-place receive takes no staging buffer."""
    gen = torch.Generator().manual_seed(11)
    dsts = {"one run": list(range(100, 164)), "two runs": [*range(10, 42), *range(200, 232)]}
    free = [
        b
        for b in torch.randperm(WIDE_BLOCKS, generator=gen).tolist()
        if not any(b in d for d in dsts.values())
    ]
    dsts["fragmented"] = free[:64]
    args = ["--transport", "ucx", "--dim", str(WIDE_DIM), "--blocks", str(WIDE_BLOCKS)]
    args += ["--sizes", ",".join(["64"] * len(dsts))]
    if src == "contiguous":
        args.append("--contiguous")
    expected = make_cache(LAYERS, WIDE_BLOCKS, BS, WIDE_DIM, SEED)
    with exporter_process(*args) as (_, handles, srcs):
        cache = torch.zeros(LAYERS, WIDE_BLOCKS, BS, WIDE_DIM)
        imp = _wide_importer(cache)

        async def run() -> dict[str, int]:
            staged_after = {}
            for (kind, dst), handle in zip(dsts.items(), handles, strict=True):
                await imp.pull(handle, dst)
                staged_after[kind] = len(imp.staging)
            await imp.transport.close()
            return staged_after

        staged_after = asyncio.run(run())
        for s, dst in zip(srcs, dsts.values(), strict=True):
            assert torch.equal(cache[:, dst], expected[:, s])
        # in-place receives took no staging buffer; the fragmented destination took one whole
        # transfer's, or, when both sides are fragmented, WINDOW chunk buffers; all came back
        fragmented = 1 if src == "contiguous" else WINDOW
        assert staged_after == {"one run": 0, "two runs": 0, "fragmented": fragmented}


def _wide_importer(cache: torch.Tensor) -> KvImporter:
    """A checksumming UCX importer into ``cache``, a WIDE layout."""
    kv = KVCacheManager(WIDE_BLOCKS, BS)
    return KvImporter(
        create_transport("ucx"), cache, kv, WIDE, transfer_timeout=10.0, verify_checksum=True
    )


def test_ucx_fragmented_sides_move_in_chunks_bit_exact() -> None:
    """Both sides fragmented: the rows go in chunks through WINDOW buffers on each side, the
    last chunk short. Destination runs and gaps (each run too short to move in place) land
    exactly, and the blocks in the gaps stay untouched."""
    n = 61
    rows_per_chunk = CHUNK_BYTES // (BS * WIDE_DIM * 4)
    assert LAYERS * n > (WINDOW + 1) * rows_per_chunk and (LAYERS * n) % rows_per_chunk
    runs = [(3, 5), (9, 7), (200, 2), (30, 15), (60, 1), (100, 12), (80, 10), (120, 9)]
    dst = [b for first, length in runs for b in range(first, first + length)]
    assert len(dst) == n
    args = ["--transport", "ucx", "--dim", str(WIDE_DIM), "--blocks", str(WIDE_BLOCKS)]
    with exporter_process(*args, "--sizes", str(n)) as (_, handles, srcs):
        cache = torch.zeros(LAYERS, WIDE_BLOCKS, BS, WIDE_DIM)
        imp = _wide_importer(cache)
        assert block_runs(srcs[0]) != [(0, n)]  # the exporter's blocks are fragmented too
        asyncio.run(_pull_once(imp, handles[0], dst))
    expected = make_cache(LAYERS, WIDE_BLOCKS, BS, WIDE_DIM, SEED)
    assert torch.equal(cache[:, dst], expected[:, srcs[0]])
    gaps = [b for b in range(WIDE_BLOCKS) if b not in dst]
    assert not cache[:, gaps].any()
    assert len(imp.staging) == WINDOW  # the chunk buffers went back for the next pull


@NETWORK
def test_layout_mismatch_is_refused_before_any_byte(transport: str) -> None:
    with exporter_process("--transport", transport, "--sizes", "3") as (_, handles, _):
        cache = torch.zeros(LAYERS, BLOCKS, BS, DIM)
        kv = KVCacheManager(BLOCKS, BS)
        other = LayoutFingerprint.latent("other-model", "float32", LAYERS, DIM, BS)
        imp = KvImporter(create_transport(transport), cache, kv, other)
        with pytest.raises(LayoutMismatch, match=r"test-model.*does not match.*other-model"):
            asyncio.run(_pull_once(imp, handles[0]))
        assert not cache.any() and kv.usage()["in_use"] == 0


def _v4_flash() -> LayoutFingerprint:
    from ferry.services.engine.model.full_size import DEEPSEEK_V4_FLASH
    from ferry.services.engine.model.v4.kv_cache import v4_cache_spec

    return LayoutFingerprint.of("v4", "bfloat16", 128, v4_cache_spec(DEEPSEEK_V4_FLASH))


def _v41_flash(kv_cache_dtype: str) -> LayoutFingerprint:
    from ferry.services.engine.model.full_size import DEEPSEEK_V41_FLASH
    from ferry.services.engine.model.v41.kv_cache import v41_cache_spec
    from ferry.services.engine.model.v41.quant import CacheFormat

    spec = v41_cache_spec(DEEPSEEK_V41_FLASH, CacheFormat(kv_cache_dtype))
    return LayoutFingerprint.of("v41", "bfloat16", 64, spec)


@pytest.mark.parametrize(
    ("theirs", "ours", "why"),
    [
        # a V4 prefill worker's handle (three paged groups and a state slot) at a V3 decode
        # worker (one latent group)
        (_v4_flash, lambda: LAYOUT, r"csa_kv.*state swa.*this one latent.*kinds of model"),
        # V4.1 prefill with --kv-cache-dtype fp8, decode without
        (
            lambda: _v41_flash("fp8"),
            lambda: _v41_flash("auto"),
            r"exporter's cache is FP8.*same --kv-cache-dtype",
        ),
    ],
    ids=["v4-at-v3", "fp8-at-bf16"],
)
def test_a_handle_of_another_layout_is_refused_saying_why(
    theirs: Callable[[], LayoutFingerprint], ours: Callable[[], LayoutFingerprint], why: str
) -> None:
    """Refused before any byte, with a message that says what differs."""
    layout = theirs()
    handle = KvHandle("t", "prefill-0", "127.0.0.1", 1, 200, layout.block_size, 4, layout, 0.0)
    cache = torch.zeros(LAYERS, BLOCKS, BS, DIM)
    kv = KVCacheManager(BLOCKS, BS)
    imp = KvImporter(create_transport("local"), cache, kv, ours())
    with pytest.raises(LayoutMismatch, match=why):
        asyncio.run(_pull_once(imp, handle))
    assert kv.usage()["in_use"] == 0


@NETWORK
def test_unpulled_lease_expires(transport: str) -> None:
    """A lease of 0 s has expired by the time any pull asks for it (waiting one out: the clock
    of test_lease_expiry_returns_blocks_to_the_exporter_pool)."""
    args = ("--transport", transport, "--sizes", "2", "--lease-seconds", "0")
    with (
        exporter_process(*args) as (_, handles, _),
        pytest.raises(LeaseNotFound, match=r"\(expired or released\)"),
    ):
        asyncio.run(_pull_once(importer(transport), handles[0]))


def test_lease_expiry_returns_blocks_to_the_exporter_pool() -> None:
    kv = KVCacheManager(32, BS)
    clock = [0.0]
    exporter = KvExporter(torch.zeros(LAYERS, 32, BS, DIM), kv, LAYOUT, "p0", lease_seconds=5)
    exporter.leases.clock = lambda: clock[0]
    kv.hold("request", [3, 4, 5])
    exporter.export([3, 4, 5], 40, "local", 0, "local")
    kv.release_hold("request")
    assert kv.usage()["in_use"] == 3
    clock[0] = 4.0
    assert exporter.leases.expire() == 0
    clock[0] = 5.5
    assert exporter.leases.expire() == 1
    assert kv.usage()["in_use"] == 0
    kv.check_integrity()


def test_local_transport_roundtrip() -> None:
    src_cache = make_cache(LAYERS, 64, BS, DIM, 3)
    kv = KVCacheManager(64, BS)
    exporter = KvExporter(src_cache, kv, LAYOUT, "p0")
    transport = create_transport("local")

    async def run() -> list[int]:
        port = await transport.serve(exporter)
        kv.hold("r", [9, 2, 40])
        handle = exporter.export([9, 2, 40], 48, "local", port, "local")
        kv.release_hold("r")
        imp = KvImporter(
            transport,
            torch.zeros(LAYERS, 64, BS, DIM),
            KVCacheManager(64, BS),
            LAYOUT,
            verify_checksum=True,
        )
        dst = await imp.pull(handle)
        assert torch.equal(imp.cache[:, dst], src_cache[:, [9, 2, 40]])
        assert len(exporter.leases) == 0  # released after the pull
        return dst

    assert len(asyncio.run(run())) == 3


def test_a_pooled_ucx_endpoint_to_a_peer_that_stopped_answering_fails_fast() -> None:
    """`make chaos`, a 60 s partition: pulls over endpoints pooled before it waited out the
    whole transfer timeout (30 s) each, and a request moved three times overran its deadline.
    The exporter's answer is bounded like a new handshake (connect_timeout)."""
    with exporter_process("--transport", "ucx", "--sizes", "4,4") as (proc, handles, _):
        imp = KvImporter(
            UcxTransport(connect_timeout=2.0),
            torch.zeros(LAYERS, BLOCKS, BS, DIM),
            KVCacheManager(BLOCKS, BS),
            LAYOUT,
            transfer_timeout=30.0,
        )

        async def run() -> tuple[str, float]:
            try:
                await imp.pull(handles[0])  # its endpoint is pooled now
                os.kill(proc.pid, signal.SIGSTOP)
                started = time.monotonic()
                with pytest.raises(TransferError) as info:
                    await imp.pull(handles[1])
                return info.value.reason, time.monotonic() - started
            finally:
                os.kill(proc.pid, signal.SIGCONT)
                await imp.transport.close()

        reason, seconds = asyncio.run(run())
    assert reason == "timeout" and seconds < 10.0  # not the transfer's 30 s
    assert imp.kv.usage()["in_use"] == 4  # the first pull's blocks, held; the second's freed


def test_a_ucx_handshake_that_never_completes_is_connect_timeout() -> None:
    """A port that accepts but never completes UCX's handshake fails after connect_timeout as
    `connect_timeout` (counted and logged), the reason a wedged UCX worker shows (see
    ucx.UCX_DEFAULTS); a dead peer's closed port usually fails at once, as `connect`."""

    def failures() -> float:
        return float(metrics.FAILED_TRANSFERS.labels("ucx", "connect_timeout")._value.get())

    async def pull(port: int) -> tuple[str, float]:
        imp = KvImporter(
            UcxTransport(connect_timeout=3.0),
            torch.zeros(LAYERS, 4, BS, DIM),
            KVCacheManager(4, BS),
            LAYOUT,
            transfer_timeout=10.0,
        )
        handle = KvHandle(
            uuid.uuid4().hex, "prefill-x", "127.0.0.1", port, 16, BS, 1, LAYOUT, time.time() + 30
        )
        started = time.monotonic()
        try:
            with pytest.raises(TransferError) as info:
                await imp.pull(handle)
        finally:
            await imp.transport.close()
        assert imp.kv.usage()["in_use"] == 0
        return info.value.reason, time.monotonic() - started

    before = failures()
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        reason, seconds = asyncio.run(pull(silent.getsockname()[1]))
    assert reason == "connect_timeout" and 2.9 < seconds < 8.0
    assert failures() == before + 1


# A process whose UCX cannot open connections (no file descriptor left) probes itself.
PROBE_WITHOUT_FDS = """
import asyncio, json, os, resource
from ferry.services.kv_transfer.ucx import UcxTransport, stop_service_threads, use_service_defaults
use_service_defaults()
async def main():
    t = UcxTransport()
    healthy = await t.probe(2.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
    starved = await t.probe(2.0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print("RESULT", json.dumps({"healthy": healthy, "starved": starved}), flush=True)
asyncio.run(main())
stop_service_threads()
os._exit(0)  # ucxx's half-made endpoints can hang a normal interpreter exit
"""


def test_the_ucx_probe_tells_a_process_that_can_no_longer_connect() -> None:
    """`UcxTransport.probe` (what workers run every --kv-probe-interval) connects to a listener
    of its own process: None while that works, a reason while it cannot. (The condition it is
    for, UCX wedged by a peer killed mid-transfer, cannot be made on demand: see
    loadtest/ucx_wedge.py for it, measured.)"""
    child = subprocess.run(
        [sys.executable, "-c", PROBE_WITHOUT_FDS], capture_output=True, text=True, timeout=60
    )
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, child.stdout + child.stderr
    report = json.loads(lines[0].removeprefix("RESULT "))
    assert report["healthy"] is None
    # without descriptors the handshake either never completes or fails at once, by timing
    starved = report["starved"] or ""
    assert starved.startswith(
        (
            "no UCX handshake with a listener of this process within 2.0s",
            "cannot open a UCX connection to this process: ",
        )
    ), starved
