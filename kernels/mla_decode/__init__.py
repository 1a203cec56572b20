from ferry.kernels.dispatch import register_lazy
from ferry.kernels.mla_decode.reference import mla_decode_torch

register_lazy("mla_decode", "triton", "ferry.kernels.mla_decode.triton_kernel")
register_lazy("mla_decode", "native", "ferry.kernels.mla_decode.native_kernel")

__all__ = ["mla_decode_torch"]
