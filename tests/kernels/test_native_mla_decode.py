"""mla_decode: the C kernel for the CPU (``paged_cpu.c``) against the torch reference, the
dispatch point's choice of it, and the build cache of :mod:`kernels.native`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry import kernels as ops
from ferry.kernels import dispatch, native
from ferry.kernels.mla_decode.native_kernel import mla_decode_native
from ferry.kernels.mla_decode.reference import mla_decode_torch

ROOT = Path(__file__).resolve().parents[2]


def _paged(
    lens: list[int], heads: int, rank: int, rope: int, block_size: int, *, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Ragged contexts in shuffled blocks, tables padded with -1; the first two requests share
    their first block when both need one (a prefix hit)."""
    gen = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen)
    q = torch.randn(len(lens), heads, rank + rope, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.long)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[start : start + n])
        start += n
    if len(lens) > 1:
        tables[1, 0] = tables[0, 0]
    return q, cache, tables, torch.tensor(lens)


# (seq_lens, heads, kv_lora_rank, rope_dim, block_size): tiny's dims, then wider and odder ones
CASES = [
    ([600], 8, 64, 16, 64),
    ([2000, 1, 64, 65, 7, 129], 8, 64, 16, 64),  # a one-token context; full and partial blocks
    ([33, 300, 9], 16, 64, 16, 16),  # two chunks of 8 heads; 16-token blocks
    ([40, 500], 24, 512, 64, 64),  # DeepSeek-V3's latent and rope dims
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{len(c[0])}-h{c[1]}-r{c[2]}")
def test_matches_the_reference(case: tuple[list[int], int, int, int, int]) -> None:
    lens, heads, rank, rope, block_size = case
    q, cache, tables, seq_lens = _paged(lens, heads, rank, rope, block_size)
    scale = (rank + rope) ** -0.5
    want = mla_decode_torch(q, cache, tables, seq_lens, scale, rank)
    got = mla_decode_native(q, cache, tables, seq_lens, scale, rank)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite() -> None:
    """Scores far apart (a head whose every score is ~-1,000 beside one near +1,000): each head
    takes its own max, so neither underflows to all zeros."""
    q, cache, tables, seq_lens = _paged([200, 70], 8, 64, 16, 64, seed=1)
    q[:, :4] *= 300.0
    q[:, 4:] *= -300.0
    want = mla_decode_torch(q, cache, tables, seq_lens, 0.1, 64)
    got = mla_decode_native(q, cache, tables, seq_lens, 0.1, 64)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_shapes_it_does_not_take_run_the_reference() -> None:
    """Heads not a multiple of 8, bfloat16, an empty batch: the torch reference's results."""
    q, cache, tables, seq_lens = _paged([9, 30, 1], 4, 16, 8, 8)
    want = mla_decode_torch(q, cache, tables, seq_lens, 0.3, 16)
    torch.testing.assert_close(mla_decode_native(q, cache, tables, seq_lens, 0.3, 16), want)
    q, cache, tables, seq_lens = _paged([50, 3], 8, 64, 16, 16)
    q16, cache16 = q.bfloat16(), cache.bfloat16()
    got = mla_decode_native(q16, cache16, tables, seq_lens, 0.3, 64)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, mla_decode_torch(q16, cache16, tables, seq_lens, 0.3, 64))
    assert mla_decode_native(q[:0], cache, tables[:0], seq_lens[:0], 0.3, 64).shape == (0, 8, 64)


def test_an_out_of_range_table_raises_instead_of_reading_past_the_cache() -> None:
    q, cache, tables, seq_lens = _paged([100, 20], 8, 64, 16, 64)
    bad = tables.clone()
    bad[0, 1] = cache.shape[0]
    with pytest.raises(IndexError, match="out of range"):
        mla_decode_native(q, cache, bad, seq_lens, 0.3, 64)
    with pytest.raises(IndexError, match="out of range"):  # a length past the table
        mla_decode_native(q, cache, tables, seq_lens * 100, 0.3, 64)
    with pytest.raises(IndexError, match="out of range"):
        mla_decode_native(q, cache, tables, torch.tensor([0, 20]), 0.3, 64)


def test_in_a_compiled_graph() -> None:
    """An opaque op at batch > 1 (the graph's code for batch 1 is the reference's)."""
    q, cache, tables, seq_lens = _paged([300, 64, 5], 8, 64, 16, 64, seed=2)
    compiled = torch.compile(mla_decode_native, dynamic=True, fullgraph=True)
    for b in (3, 1):
        want = mla_decode_torch(q[:b], cache, tables[:b], seq_lens[:b], 0.3, 64)
        torch.testing.assert_close(
            compiled(q[:b], cache, tables[:b], seq_lens[:b], 0.3, 64), want, rtol=1e-5, atol=1e-5
        )


def test_dispatch_picks_it_on_the_cpu_unless_torch_is_forced() -> None:
    cpu = torch.device("cpu")
    assert dispatch.resolve("mla_decode", cpu) is mla_decode_native
    assert dispatch.resolve("rms_norm", cpu) is ops.rmsnorm.rms_norm_torch
    try:
        dispatch.set_backend("torch")
        assert dispatch.resolve("mla_decode", cpu) is mla_decode_torch
        dispatch.set_backend("native")  # the C kernels where an op has one, torch elsewhere
        assert dispatch.resolve("mla_decode", cpu) is mla_decode_native
        assert dispatch.resolve("rms_norm", cpu) is ops.rmsnorm.rms_norm_torch
        with pytest.raises(RuntimeError, match="native kernels run on CPU tensors"):
            dispatch.resolve("mla_decode", torch.device("cuda"))
    finally:
        dispatch.set_backend("auto")


def test_a_kernel_that_cannot_build_falls_back_to_torch(tmp_path: Path) -> None:
    """No compiler: one warning that says why, then the torch reference; forcing native is an
    error that says why."""
    env = {k: v for k, v in os.environ.items() if k != "FERRY_KERNELS"}
    env.update(CC=str(tmp_path / "no-such-cc"), FERRY_NATIVE_CACHE=str(tmp_path / "cache"))
    code = (
        "import warnings, torch\n"
        "from ferry import kernels\n"
        "from ferry.kernels import dispatch\n"
        "from ferry.kernels.mla_decode.reference import mla_decode_torch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    fn = dispatch.resolve('mla_decode', torch.device('cpu'))\n"
        "    dispatch.resolve('mla_decode', torch.device('cpu'))\n"
        "assert fn is mla_decode_torch, fn\n"
        "assert len(caught) == 1 and 'no C compiler' in str(caught[0].message), caught\n"
        "dispatch.set_backend('native')\n"
        "dispatch.resolve('mla_decode', torch.device('cpu'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode != 0, run.stdout
    assert "cannot import ferry.kernels.mla_decode.native_kernel" in run.stderr, run.stderr
    assert "no C compiler" in run.stderr.strip().splitlines()[-1], run.stderr


def test_builds_once_per_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_NATIVE_CACHE", str(tmp_path))
    source = tmp_path / "add.c"
    source.write_text("int add(int a, int b) { return a + b; }\n")
    assert native.load(source).add(2, 3) == 5
    (built,) = tmp_path.glob("add-*.so")
    stamp = built.stat().st_mtime_ns
    native.load.cache_clear()
    assert native.load(source).add(4, 3) == 7
    assert built.stat().st_mtime_ns == stamp and list(tmp_path.glob("add-*.so")) == [built]
    source.write_text("int add(int a, int b) { return a + b + 1; }\n")  # edited: its own build
    native.load.cache_clear()
    assert native.load(source).add(2, 3) == 6
    assert len(list(tmp_path.glob("add-*.so"))) == 2
    source.write_text("int add(int a, int b) { return a + ; }\n")
    native.load.cache_clear()
    with pytest.raises(native.BuildError, match=r"could not build add\.c"):
        native.load(source)
    native.load.cache_clear()


def test_an_unwritable_cache_says_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FERRY_NATIVE_CACHE", str(blocker / "cache"))  # under a file
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    native.load.cache_clear()
    with pytest.raises(native.BuildError, match="set FERRY_NATIVE_CACHE"):
        native.load(source)
    native.load.cache_clear()
