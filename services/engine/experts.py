"""ExpertPlacement: which logical expert each physical slot holds, per MoE layer.

The router picks *logical* experts; the placement turns each choice into a *physical slot* — a
replica of that expert. Wide-EP spreads the slots over ranks (``slots_per_rank`` each, rank r owns
slots ``[r * slots_per_rank, (r + 1) * slots_per_rank)``) and EPLB rewrites the map while serving;
the model's math only ever sees slot ids. One rank with no redundant experts is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    # [num_moe_layers, num_slots] int64: the logical expert held by each physical slot.
    slot_to_logical: torch.Tensor
    num_logical_experts: int
    ep_size: int = 1
    ep_rank: int = 0
    # Derived in __post_init__: [L, E, max_replicas] slot ids (padded with -1), [L, E] counts.
    logical_to_slots: torch.Tensor = field(init=False, repr=False, compare=False)
    replica_counts: torch.Tensor = field(init=False, repr=False, compare=False)
    # The same for the replicas on this rank: [L, E, max_local] slot ids and [L, E] counts.
    local_to_slots: torch.Tensor = field(init=False, repr=False, compare=False)
    local_counts: torch.Tensor = field(init=False, repr=False, compare=False)
    is_identity: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s2l = self.slot_to_logical
        if s2l.dim() != 2:
            raise ValueError("slot_to_logical must be [num_moe_layers, num_slots]")
        num_layers, num_slots = s2l.shape
        if num_slots % self.ep_size:
            raise ValueError(f"{num_slots} slots do not split evenly over {self.ep_size} ranks")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} outside 0..{self.ep_size - 1}")
        if num_layers and (s2l.min() < 0 or s2l.max() >= self.num_logical_experts):
            raise ValueError("slot_to_logical names an expert outside 0..num_logical_experts-1")
        counts = torch.zeros(num_layers, self.num_logical_experts, dtype=torch.long)
        counts.scatter_add_(1, s2l, torch.ones_like(s2l))
        if num_layers and counts.min() == 0:
            layer, expert = (counts == 0).nonzero()[0].tolist()
            raise ValueError(f"MoE layer {layer}: logical expert {expert} has no slot")
        max_rep = int(counts.max()) if num_layers else 1
        table = torch.full((num_layers, self.num_logical_experts, max_rep), -1, dtype=torch.long)
        for layer in range(num_layers):
            filled = [0] * self.num_logical_experts
            for slot, expert in enumerate(s2l[layer].tolist()):
                table[layer, expert, filled[expert]] = slot
                filled[expert] += 1
        start = self.ep_rank * (num_slots // self.ep_size)
        mine = (table >= start) & (table < start + num_slots // self.ep_size)
        local_counts = mine.sum(dim=2)
        # this rank's replicas first in each row (stable sort keeps slot order)
        local_table = torch.gather(table, 2, torch.argsort((~mine).int(), dim=2, stable=True))
        object.__setattr__(self, "local_to_slots", local_table)
        object.__setattr__(self, "local_counts", local_counts)
        object.__setattr__(self, "logical_to_slots", table)
        object.__setattr__(self, "replica_counts", counts)
        identity = num_slots == self.num_logical_experts and bool(
            (s2l == torch.arange(num_slots)).all()
        )
        object.__setattr__(self, "is_identity", identity)

    @classmethod
    def identity(cls, num_moe_layers: int, num_experts: int) -> ExpertPlacement:
        s2l = torch.arange(num_experts).repeat(num_moe_layers, 1)
        return cls(slot_to_logical=s2l, num_logical_experts=num_experts)

    @classmethod
    def spread(
        cls,
        num_moe_layers: int,
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        num_redundant: int = 0,
    ) -> ExpertPlacement:
        """The starting placement of a DEP group: experts in order over the slots, then one
        extra replica each of the first ``num_redundant`` experts (EPLB moves them later)."""
        num_slots = num_experts + num_redundant
        if num_slots % ep_size:
            raise ValueError(
                f"{num_experts} experts + {num_redundant} redundant = {num_slots} "
                f"slots do not split evenly over {ep_size} ranks"
            )
        row = torch.cat([torch.arange(num_experts), torch.arange(num_redundant) % num_experts])
        return cls(
            slot_to_logical=row.repeat(num_moe_layers, 1),
            num_logical_experts=num_experts,
            ep_size=ep_size,
            ep_rank=ep_rank,
        )

    @property
    def num_moe_layers(self) -> int:
        return int(self.slot_to_logical.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.slot_to_logical.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    @property
    def local_slots(self) -> range:
        """Global ids of the slots whose weights live on this rank."""
        start = self.ep_rank * self.slots_per_rank
        return range(start, start + self.slots_per_rank)

    def local_experts(self, moe_layer: int) -> list[int]:
        """Logical expert held by each local slot of one MoE layer, in slot order."""
        row = self.slot_to_logical[moe_layer]
        return [int(row[s]) for s in self.local_slots]

    def select_slots(self, moe_layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Map logical choices [num_tokens, top_k] to physical slots of the same shape.

        A choice goes to a replica on this rank when there is one (no exchange needed), else to
        any replica; among the candidates, token ``t`` takes number ``t % count``, so that the
        load of a replicated expert is spread evenly.
        """
        if self.is_identity:
            return topk_ids
        dev = topk_ids.device
        token = torch.arange(topk_ids.shape[0], device=dev)[:, None]
        counts = self.replica_counts[moe_layer].to(dev)[topk_ids]
        chosen = self.logical_to_slots[moe_layer].to(dev)[topk_ids, token % counts]
        if self.ep_size == 1:
            return chosen
        local_counts = self.local_counts[moe_layer].to(dev)[topk_ids]
        local = self.local_to_slots[moe_layer].to(dev)[topk_ids, token % local_counts.clamp(min=1)]
        return torch.where(local_counts > 0, local, chosen)
