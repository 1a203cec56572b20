from kernels.dispatch import register_lazy
from kernels.moe_routing.reference import expert_counts_torch, moe_route_torch

register_lazy("moe_route", "triton", "kernels.moe_routing.triton_kernel")
register_lazy("expert_counts", "triton", "kernels.moe_routing.triton_kernel")

__all__ = ["expert_counts_torch", "moe_route_torch"]
