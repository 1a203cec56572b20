"""ferry.v1.PlacementMap <-> a [num_moe_layers, num_slots] array of the logical expert each
physical slot holds: the EPLB controller's orders and the ranks' answers (numpy, no torch)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ferry.protos import eplb_pb2


class SlotMap(Protocol):
    """A [num_moe_layers, num_slots] integer array: numpy's or torch's."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def tolist(self) -> list[list[int]]: ...


def placement_map(version: int, slot_to_logical: SlotMap) -> eplb_pb2.PlacementMap:
    layers, slots = slot_to_logical.shape
    rows = slot_to_logical.tolist()
    return eplb_pb2.PlacementMap(
        version=version,
        num_moe_layers=layers,
        num_slots=slots,
        slot_to_logical=[e for row in rows for e in row],
    )


def slot_map(m: eplb_pb2.PlacementMap) -> np.ndarray:
    """[num_moe_layers, num_slots] int64; ValueError when the sizes do not add up."""
    if m.num_moe_layers * m.num_slots != len(m.slot_to_logical) or not m.num_slots:
        raise ValueError(
            f"{len(m.slot_to_logical)} slot entries for {m.num_moe_layers} MoE "
            f"layers x {m.num_slots} slots"
        )
    return np.array(m.slot_to_logical, dtype=np.int64).reshape(m.num_moe_layers, m.num_slots)
