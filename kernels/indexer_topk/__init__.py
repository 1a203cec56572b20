from ferry.kernels.dispatch import register_lazy
from ferry.kernels.indexer_topk.reference import indexer_topk_torch

register_lazy("indexer_topk", "triton", "ferry.kernels.indexer_topk.triton_kernel")

__all__ = ["indexer_topk_torch"]
