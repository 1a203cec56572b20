from kernels.mla_prefill.reference import prefill_attention_torch

__all__ = ["prefill_attention_torch"]
