from ferry.kernels.dispatch import register_lazy
from ferry.kernels.sparse_mqa.reference import sparse_mqa_torch

register_lazy("sparse_mqa", "triton", "ferry.kernels.sparse_mqa.triton_kernel")

__all__ = ["sparse_mqa_torch"]
