"""EPLB placement: property tests on seeded skewed loads, tiny to DeepSeek-V3 scale."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.eplb_controller import (
    Placement,
    balancedness,
    layer_balancedness,
    rebalance,
    rebalance_layers,
    slots_changed,
)
from ferry.services.eplb_controller.service import Schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))  # its scripts' modules
from reference_eplb import rebalance_experts


class Config(NamedTuple):
    name: str
    num_layers: int
    num_experts: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int

    @property
    def hierarchical(self) -> bool:
        return self.num_groups % self.num_nodes == 0

    def args(self) -> tuple[int, int, int, int]:
        return self.num_replicas, self.num_groups, self.num_nodes, self.num_gpus


CONFIGS = [
    Config("tiny-ep2", 3, 16, 18, 4, 1, 2),  # the tiny preset: 3 MoE layers, 16 experts
    Config("tiny-ep4-2nodes", 3, 16, 20, 4, 2, 4),  # hierarchical over two nodes
    Config("small-ep6-global", 5, 32, 36, 4, 3, 6),  # 4 groups % 3 nodes: global policy
    Config("v3-ep32", 58, 256, 288, 8, 4, 32),  # DeepSeek-V3, hierarchical
    Config("v3-ep144", 58, 256, 288, 8, 18, 144),  # DeepSeek-V3, global, 2 slots per GPU
]
KINDS = ["zipf", "lognormal"]


def skewed_loads(kind: str, num_layers: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """[L, E] token counts: Zipf(1) or lognormal(sigma=1) over experts, shuffled per layer."""
    rng = np.random.default_rng(seed)
    if kind == "zipf":
        shape = 1.0 / np.arange(1, num_experts + 1)
        weight = np.stack([rng.permutation(shape) for _ in range(num_layers)])
    else:
        weight = rng.lognormal(0.0, 1.0, (num_layers, num_experts))
    return np.round(weight / weight.sum(1, keepdims=True) * 100_000)


def drifted(weight: np.ndarray, seed: int = 1) -> np.ndarray:
    """The same loads after ~10% multiplicative noise."""
    return weight * np.random.default_rng(seed).lognormal(0.0, 0.1, weight.shape)


def trivial(cfg: Config) -> torch.Tensor:
    """The starting placement of a DEP group: experts in order, then the first R redundant."""
    extra = cfg.num_replicas - cfg.num_experts
    spread = ExpertPlacement.spread(cfg.num_layers, cfg.num_experts, cfg.num_gpus, 0, extra)
    return spread.slot_to_logical


def check_valid(p: Placement, cfg: Config) -> None:
    """Every invariant a placement must keep, against the engine's own view of the slot map."""
    L, E, R = cfg.num_layers, cfg.num_experts, cfg.num_replicas
    assert p.phy2log.shape == (L, R) and p.phy2log.dtype == np.int64
    phy2log, log2phy, logcnt = (torch.from_numpy(a) for a in (p.phy2log, p.log2phy, p.logcnt))
    assert (logcnt >= 1).all() and (logcnt.sum(1) == R).all()
    per_gpu = phy2log.view(L, cfg.num_gpus, -1)
    distinct = per_gpu.sort(-1).values.diff(dim=-1) != 0
    assert distinct.all(), "a GPU holds two replicas of one expert"
    assert logcnt.max() <= cfg.num_gpus // (cfg.num_nodes if cfg.hierarchical else 1)
    last = cfg.num_gpus - 1
    engine = ExpertPlacement(
        slot_to_logical=phy2log, num_logical_experts=E, ep_size=cfg.num_gpus, ep_rank=last
    )
    assert torch.equal(engine.replica_counts, logcnt)
    assert torch.equal(engine.logical_to_slots, log2phy)
    assert engine.local_experts(0) == per_gpu[0, last].tolist()
    slot = log2phy.clamp(min=0)
    held = phy2log.gather(1, slot.flatten(1)).view(slot.shape)
    assert ((held == torch.arange(E)[:, None]) | (log2phy < 0)).all()
    if cfg.hierarchical:  # each group's slots on one node
        group = phy2log // (E // cfg.num_groups)
        node = torch.arange(R) // (R // cfg.num_nodes)
        for layer in range(L):  # as many (group, node) pairs as groups
            assert len(torch.unique(group[layer] * cfg.num_nodes + node)) == cfg.num_groups


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_valid_and_balanced(cfg: Config, kind: str) -> None:
    weight = skewed_loads(kind, cfg.num_layers, cfg.num_experts)
    p = rebalance(weight, *cfg.args())
    check_valid(p, cfg)
    assert p.slots_moved is None
    ours = layer_balancedness(weight, p, cfg.num_gpus)
    assert (ours >= layer_balancedness(weight, trivial(cfg), cfg.num_gpus) - 1e-9).all()
    assert balancedness(weight, p, cfg.num_gpus) == pytest.approx(float(ours.mean()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=lambda c: c.name)
def test_at_least_as_balanced_as_published(cfg: Config, kind: str) -> None:
    weight = skewed_loads(kind, cfg.num_layers, cfg.num_experts, seed=2)
    published, _, _ = rebalance_experts(torch.from_numpy(weight), *cfg.args())
    ours = rebalance(weight, *cfg.args())
    assert balancedness(weight, ours, cfg.num_gpus) >= balancedness(weight, published, cfg.num_gpus)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_previous_moves_fewer_slots(cfg: Config) -> None:
    weight = skewed_loads("lognormal", cfg.num_layers, cfg.num_experts)
    first = rebalance(weight, *cfg.args())
    later = drifted(weight)
    fresh = rebalance(later, *cfg.args())
    kept = rebalance(later, *cfg.args(), previous=first, tolerance=0.0)
    check_valid(kept, cfg)
    assert kept.slots_moved == slots_changed(first, kept)
    assert kept.slots_moved < slots_changed(first, fresh)
    # tolerance 0: no layer balances worse than the fresh placement
    before = layer_balancedness(later, fresh, cfg.num_gpus)
    assert (layer_balancedness(later, kept, cfg.num_gpus) >= before - 1e-12).all()
    # previous as a phy2log (numpy or a host tensor) is the same as a Placement
    again = rebalance(later, *cfg.args(), previous=torch.from_numpy(first.phy2log), tolerance=0.0)
    assert np.array_equal(again.phy2log, kept.phy2log)


def test_previous_from_another_policy_is_replaced() -> None:
    # the trivial placement keeps no group on one node: the hierarchical policy starts afresh
    cfg = CONFIGS[3]
    weight = skewed_loads("zipf", cfg.num_layers, cfg.num_experts)
    p = rebalance(weight, *cfg.args(), previous=trivial(cfg))
    check_valid(p, cfg)
    assert p.slots_moved == slots_changed(trivial(cfg), p) > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_same_loads_keep_the_placement(cfg: Config, kind: str) -> None:
    weight = skewed_loads(kind, cfg.num_layers, cfg.num_experts)
    first = rebalance(weight, *cfg.args())
    again = rebalance(weight, *cfg.args(), previous=first)
    assert again.slots_moved == 0 and np.array_equal(again.phy2log, first.phy2log)


def test_hot_expert_gets_at_most_one_replica_per_gpu() -> None:
    # expert 0 takes 90% of the tokens: it would like every slot, it gets one per GPU
    weight = np.ones((2, 8))
    weight[:, 0] = 63.0
    cfg = Config("hot", 2, 8, 16, 1, 1, 4)
    p = rebalance(weight, *cfg.args())
    check_valid(p, cfg)
    assert p.logcnt[:, 0].tolist() == [4, 4]


def test_accepts_torch_and_zero_loads() -> None:
    cfg = CONFIGS[0]
    weight = torch.from_numpy(skewed_loads("zipf", cfg.num_layers, cfg.num_experts))
    weight[1] = 0  # a layer that routed nothing
    p = rebalance(weight, *cfg.args())
    check_valid(p, cfg)
    assert layer_balancedness(weight, p, cfg.num_gpus)[1] == 1.0


@pytest.mark.parametrize(
    ("shape", "args", "message"),
    [
        ((2, 16), (18, 4, 1, 4), r"num_replicas % num_gpus = 18 % 4 = 2"),
        ((2, 16), (20, 4, 3, 4), r"num_gpus % num_nodes = 4 % 3 = 1"),
        ((2, 16), (20, 5, 1, 4), r"num_logical_experts % num_groups = 16 % 5 = 1"),
        ((2, 16), (12, 4, 1, 4), r"num_replicas 12 < num_logical_experts 16"),
        ((2, 16), (32, 4, 2, 2), r"16 slots per GPU but 8 experts per node"),
        ((2, 18), (38, 3, 2, 2), r"19 slots per GPU but 18 experts per cluster"),
        ((2, 16), (16, 4, 0, 4), r"num_nodes must be positive"),
        ((16,), (16, 4, 1, 4), r"weight must be \[num_layers, num_logical_experts\]"),
    ],
)
def test_errors(shape: tuple[int, ...], args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance(np.ones(shape), *args)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="finite and non-negative"):
        rebalance(-np.ones((2, 16)), 16, 4, 1, 4)
    with pytest.raises(ValueError, match=r"previous placement is \(2, 18\), expected \(2, 16\)"):
        rebalance(np.ones((2, 16)), 16, 4, 1, 4, previous=np.zeros((2, 18), dtype=np.int64))
    with pytest.raises(ValueError, match=r"outside 0\.\.15"):
        rebalance(np.ones((2, 16)), 16, 4, 1, 4, previous=np.full((2, 16), 16))
    with pytest.raises(ValueError, match="differ in shape"):
        slots_changed(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 18, dtype=torch.long))


def test_rebalancing_some_layers_keeps_the_others_slots() -> None:
    """The learned layers rebalanced alone (hash-routed ones wait for their own interval):
    the others hold exactly the experts they held; the chosen ones as ``rebalance`` places
    them."""
    rng = np.random.default_rng(5)
    weight = rng.lognormal(0.0, 1.0, (5, 16))
    prev = ExpertPlacement.spread(5, 16, 4, 0, 4).slot_to_logical.numpy()
    learned = [2, 3, 4]
    new = rebalance_layers(weight, 20, 1, 1, 4, prev, learned)
    assert (new.phy2log[:2] == prev[:2]).all()
    alone = rebalance(weight[learned], 20, 1, 1, 4, prev[learned])
    assert (new.phy2log[learned] == alone.phy2log).all()
    assert new.slots_moved == alone.slots_moved > 0


def test_hash_routed_layers_are_due_less_often() -> None:
    schedule = Schedule(every=100, hash_every=1000)
    due = []
    for steps in range(0, 2101, 100):
        learned, hashed = schedule.due(steps)
        schedule.done(steps, learned, hashed)
        due.append((learned, hashed))
    assert sum(learned for learned, _ in due) == 21 and sum(h for _, h in due) == 2
    assert Schedule(every=0, hash_every=0).due(10**6) == (False, False)
