from ferry.kernels.dispatch import register_lazy
from ferry.kernels.rmsnorm.reference import add_rms_norm_torch, rms_norm_torch

register_lazy("rms_norm", "triton", "ferry.kernels.rmsnorm.triton_kernel")
register_lazy("add_rms_norm", "triton", "ferry.kernels.rmsnorm.triton_kernel")

__all__ = ["add_rms_norm_torch", "rms_norm_torch"]
