from ferry.kernels.sink_attention.reference import sink_attention_torch

__all__ = ["sink_attention_torch"]
