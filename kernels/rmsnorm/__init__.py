from kernels.rmsnorm.reference import add_rms_norm_torch, rms_norm_torch

__all__ = ["add_rms_norm_torch", "rms_norm_torch"]
