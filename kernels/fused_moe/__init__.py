from kernels.fused_moe.reference import fused_moe_torch

__all__ = ["fused_moe_torch"]
