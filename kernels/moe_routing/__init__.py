from ferry.kernels.dispatch import register_lazy
from ferry.kernels.moe_routing.reference import expert_counts_torch, moe_route_torch

register_lazy("moe_route", "triton", "ferry.kernels.moe_routing.triton_kernel")
register_lazy("expert_counts", "triton", "ferry.kernels.moe_routing.triton_kernel")

__all__ = ["expert_counts_torch", "moe_route_torch"]
