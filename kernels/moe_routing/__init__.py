from kernels.moe_routing.reference import moe_route_torch

__all__ = ["moe_route_torch"]
