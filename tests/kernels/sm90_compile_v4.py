"""The DeepSeek-V4 kernels compiled for sm_90 at V4-Flash's shapes (see sm90_compile.py): sparse
attention over 64 heads of dim 512 reading a 128-row window and 512 indexer picks, the CSA (8
rows) and HCA (128 rows) pooling of 512-wide entries, and the indexer's 64 heads of dim 128
choosing 512 of 25600 entries."""

from __future__ import annotations

from ferry.kernels.indexer_topk import triton_kernel as indexer
from ferry.kernels.sparse_mqa import triton_kernel as sparse
from ferry.kernels.v4_compress import triton_kernel as pool
from tests.kernels.sm90_compile import BF16, FP32, I64, Build, build

HEADS, HEAD_DIM, WINDOW, INDEX_TOPK = 64, 512, 128, 512
INDEX_HEADS, INDEX_DIM, ENTRIES = 64, 128, 25_600


def deepseek_v4_builds() -> list[Build]:
    """Every V4 kernel as its op launches it in bfloat16, with its default blocks."""
    return [
        _sparse_mqa(),
        _compress_pool("CSA", rows=8),
        _compress_pool("HCA", rows=128),
        _indexer_topk(shared=True),
        _indexer_topk(shared=False),
    ]


def _sparse_mqa() -> Build:
    b = sparse.SparseBlocks()
    k = WINDOW + INDEX_TOPK
    return build(
        "sparse_mqa",
        sparse._sparse_mqa_kernel,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
        q_ptr=BF16,
        kv_ptr=BF16,
        idx_ptr=I64,
        sinks_ptr=FP32,
        out_ptr=BF16,
        num_heads=HEADS,
        dim=HEAD_DIM,
        num_indices=k,
        scale_log2=0.06,
        q_stride_t=HEADS * HEAD_DIM,
        q_stride_h=HEAD_DIM,
        kv_stride=HEAD_DIM,
        idx_stride=k,
        out_stride_t=HEADS * HEAD_DIM,
        out_stride_h=HEAD_DIM,
        BLOCK_H=min(b.block_h, HEADS),
        BLOCK_K=b.block_k,
        BLOCK_D=HEAD_DIM,
    )


def _compress_pool(name: str, rows: int, width: int = HEAD_DIM) -> Build:
    """kv and gate as the halves of one [entries, rows, 2 x width] projection."""
    b = pool.PoolBlocks()
    block_r = min(rows, b.block_r)
    return build(
        f"compress_pool {name} (rows {rows})",
        pool._compress_pool_kernel,
        num_warps=b.num_warps,
        kv_ptr=BF16,
        gate_ptr=BF16,
        out_ptr=BF16,
        rows=rows,
        width=width,
        kv_stride_n=rows * 2 * width,
        kv_stride_r=2 * width,
        gate_stride_n=rows * 2 * width,
        gate_stride_r=2 * width,
        ONE_TILE=True,
        BLOCK_R=block_r,
        BLOCK_W=min(width, max(32, b.tile // block_r)),
    )


def _indexer_topk(shared: bool) -> Build:
    b = indexer.IndexerBlocks()
    return build(
        f"indexer_topk ({'shared' if shared else 'per-query'} keys)",
        indexer._indexer_topk_kernel,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
        q_ptr=BF16,
        w_ptr=FP32,
        keys_ptr=BF16,
        visible_ptr=I64,
        out_ptr=I64,
        num_heads=INDEX_HEADS,
        dim=INDEX_DIM,
        num_entries=ENTRIES,
        k=INDEX_TOPK,
        scale=INDEX_DIM**-0.5,
        q_stride_t=INDEX_HEADS * INDEX_DIM,
        q_stride_h=INDEX_DIM,
        w_stride_t=INDEX_HEADS,
        keys_stride_t=0 if shared else ENTRIES * INDEX_DIM,
        keys_stride_e=INDEX_DIM,
        BLOCK_H=INDEX_HEADS,
        BLOCK_D=INDEX_DIM,
        BLOCK_E=b.block_e,
        CHUNK=max(INDEX_TOPK, b.block_e),
    )
