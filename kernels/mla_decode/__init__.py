from kernels.mla_decode.reference import mla_decode_torch

__all__ = ["mla_decode_torch"]
