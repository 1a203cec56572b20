"""ExpertPlacement: the slot map is a seam the math never sees."""

from __future__ import annotations

import pytest
import torch

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model import load_model, prompt_logits


def test_identity() -> None:
    p = ExpertPlacement.identity(num_moe_layers=3, num_experts=8)
    assert p.is_identity and p.num_slots == 8 and p.local_slots == range(8)
    ids = torch.tensor([[1, 5], [7, 0]])
    assert torch.equal(p.select_slots(2, ids), ids)


def test_replicas_spread_tokens() -> None:
    # 4 experts in 6 slots: expert 2 has three replicas, expert 0 two.
    s2l = torch.tensor([[2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 2, 2]])
    p = ExpertPlacement(slot_to_logical=s2l, num_logical_experts=4, ep_size=2, ep_rank=1)
    assert not p.is_identity
    assert p.replica_counts[0].tolist() == [2, 1, 2, 1]
    assert p.local_slots == range(3, 6) and p.local_experts(0) == [2, 3, 0]
    one_rank = ExpertPlacement(slot_to_logical=s2l, num_logical_experts=4)
    slots = one_rank.select_slots(1, torch.full((6, 1), 2))
    assert sorted(slots.flatten().tolist()) == [2, 2, 4, 4, 5, 5]  # three replicas, evenly
    assert (s2l[1][slots] == 2).all()
    # rank 1 holds two of expert 2's replicas (slots 4, 5): its tokens stay there, evenly
    assert sorted(p.select_slots(1, torch.full((6, 1), 2)).flatten().tolist()) == [4, 4, 4, 5, 5, 5]
    # expert 1 of layer 0 lives only on rank 0 (slot 2): rank 1 sends it there
    assert p.select_slots(0, torch.full((3, 1), 1)).flatten().tolist() == [2, 2, 2]
    # rank 0 holds expert 2's replica slot 2 of layer 1, and no other
    rank0 = ExpertPlacement(slot_to_logical=s2l, num_logical_experts=4, ep_size=2, ep_rank=0)
    assert rank0.select_slots(1, torch.full((4, 1), 2)).flatten().tolist() == [2, 2, 2, 2]


def test_invalid_placements() -> None:
    with pytest.raises(ValueError, match="logical expert 3 has no slot"):
        ExpertPlacement(slot_to_logical=torch.tensor([[0, 1, 2, 2]]), num_logical_experts=4)
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertPlacement(slot_to_logical=torch.tensor([[0, 1, 2]]), num_logical_experts=3, ep_size=2)


def test_redundant_permuted_placement_keeps_logits() -> None:
    """The tiny preset with its 16 experts shuffled over 24 slots (8 replicas) computes the
    same logits as the identity placement."""
    ref_model = load_model("tiny")
    cfg = ref_model.config
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(cfg.num_moe_layers):
        extra = torch.randint(0, cfg.n_routed_experts, (8,), generator=gen)
        row = torch.cat([torch.arange(cfg.n_routed_experts), extra])
        rows.append(row[torch.randperm(len(row), generator=gen)])
    placement = ExpertPlacement(
        slot_to_logical=torch.stack(rows), num_logical_experts=cfg.n_routed_experts
    )
    model = load_model("tiny", placement=placement)
    assert model.model.layers[1].mlp.experts.w13.shape[0] == 24
    ids = list(range(0, 256, 3))
    torch.testing.assert_close(
        prompt_logits(model, ids), prompt_logits(ref_model, ids), rtol=1e-6, atol=1e-6
    )
