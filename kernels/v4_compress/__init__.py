from ferry.kernels.dispatch import register_lazy
from ferry.kernels.v4_compress.reference import compress_pool_torch

register_lazy("compress_pool", "triton", "ferry.kernels.v4_compress.triton_kernel")

__all__ = ["compress_pool_torch"]
