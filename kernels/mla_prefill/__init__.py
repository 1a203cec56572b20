from ferry.kernels.dispatch import register_lazy
from ferry.kernels.mla_prefill.reference import prefill_attention_torch

register_lazy("prefill_attention", "triton", "ferry.kernels.mla_prefill.triton_kernel")

__all__ = ["prefill_attention_torch"]
