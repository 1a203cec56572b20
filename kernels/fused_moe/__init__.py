from ferry.kernels.dispatch import register_lazy
from ferry.kernels.fused_moe.reference import fused_moe_torch

register_lazy("fused_moe", "triton", "ferry.kernels.fused_moe.triton_kernel")

__all__ = ["fused_moe_torch"]
