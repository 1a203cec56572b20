"""EPLB controller: expert placement (``algorithm``) for a DEP group's MoE layers."""

from ferry.services.eplb_controller.algorithm import (
    Placement,
    balancedness,
    layer_balancedness,
    rebalance,
    rebalance_layers,
    slots_changed,
)

__all__ = [
    "Placement",
    "balancedness",
    "layer_balancedness",
    "rebalance",
    "rebalance_layers",
    "slots_changed",
]
