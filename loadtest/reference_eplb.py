"""Baseline only: a re-implementation of DeepSeek's published EPLB (deepseek-ai/EPLB, ``eplb.py``).

It follows the published algorithm step by step, Python loops included, so that the benchmark
and the tests can compare Ferry's placement (``algorithm.rebalance``) against it in one run:

- hierarchical policy (``num_groups % num_nodes == 0``): pack expert groups onto nodes with
  balanced packing, replicate experts within each node (each extra replica goes to the expert
  with the highest load per replica), pack the node's replicas onto its GPUs;
- global policy otherwise: the same with one node and one group.

Balanced packing is greedy: items heaviest first, each to the lightest pack that has room. Like
the original, it may put two replicas of one expert on one GPU. Serving code uses
``algorithm.rebalance``; nothing but the benchmark and the tests imports this module.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[X, n] weights → (pack of each item, rank of the item in its pack), both [X, n]; every
    pack gets n / num_packs items."""
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        identity = torch.arange(num_items).expand(num_rows, num_items).clone()
        return identity, torch.zeros(num_rows, num_items, dtype=torch.int64)
    order = weight.float().sort(-1, descending=True).indices
    pack_index = torch.full((num_rows, num_items), -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    for row in range(num_rows):
        pack_weights = [0.0] * num_packs
        pack_items = [0] * num_packs
        for item in order[row].tolist():
            open_packs = (p for p in range(num_packs) if pack_items[p] < per_pack)
            pack = min(open_packs, key=pack_weights.__getitem__)
            pack_index[row, item] = pack
            rank_in_pack[row, item] = pack_items[pack]
            pack_weights[pack] += float(weight[row, item])
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(
    weight: torch.Tensor, num_phy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[X, num_log] loads → (phy2log [X, num_phy], replica rank [X, num_phy], logcnt [X, num_log]):
    each extra replica goes to the expert with the highest load per replica."""
    num_rows, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(num_rows, 1)
    rank = torch.zeros(num_rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(num_rows, num_log, dtype=torch.int64)
    rows = torch.arange(num_rows)
    for slot in range(num_log, num_phy):
        expert = (weight / logcnt).max(dim=-1).indices
        phy2log[:, slot] = expert
        rank[:, slot] = logcnt[rows, expert]
        logcnt[rows, expert] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1)).expand(perm.shape))
    return inv


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ (phy2log [L, num_physical], replica rank [L, num_physical], logcnt [L, E])."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus

    # 1. groups onto nodes; mlog = expert ids renumbered node by node
    group_tokens = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(group_tokens, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
        + torch.arange(group_size)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # 2. replicas within each node: [L * num_nodes, E // num_nodes]
    mlog_tokens = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_tokens, num_physical // num_nodes)

    # 3. each node's replicas onto its GPUs
    phy_tokens = (mlog_tokens / mlogcnt).gather(-1, phy2mlog)
    pack, rank = balanced_packing(phy_tokens, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_offset = torch.arange(0, num_logical, num_logical // num_nodes).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1) + node_offset).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[L, E] loads → (phy2log [L, num_replicas], log2phy [L, E, max_replicas], logcnt [L, E])."""
    num_layers, num_logical = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, 1, 1, num_gpus
        )
    max_count = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical, max_count), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(
        -1, phy2log * max_count + phyrank, torch.arange(num_replicas).expand(num_layers, -1)
    )
    return phy2log, log2phy, logcnt
