from kernels.dispatch import register_lazy
from kernels.mla_prefill.reference import prefill_attention_torch

register_lazy("prefill_attention", "triton", "kernels.mla_prefill.triton_kernel")

__all__ = ["prefill_attention_torch"]
