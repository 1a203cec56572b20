"""DeepSeek routing: scores (V3's sigmoid, V4's sqrt(softplus)), bias-corrected group-limited
top-k, scaled weights."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import register

SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


def expert_scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Per-expert scores from float32 router logits [num_tokens, num_experts]."""
    if scoring_func == "sigmoid":
        return router_logits.sigmoid()
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(router_logits).sqrt()
    if scoring_func == "softmax":
        return router_logits.softmax(dim=-1)
    raise ValueError(f"scoring_func {scoring_func!r}: one of {', '.join(SCORING_FUNCS)}")


@register("moe_route", "torch")
def moe_route_torch(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` logical experts per token.

    router_logits: [num_tokens, num_experts] float32. The correction bias only steers *which*
    experts are chosen; the weights come from the unbiased scores (``expert_scores``). Groups are ranked by the
    sum of their two best biased scores and only the ``topk_group`` best groups are eligible.
    Returns (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64).
    """
    scores = expert_scores(router_logits, scoring_func)
    choice = scores if correction_bias is None else scores + correction_bias
    num_tokens, num_experts = choice.shape
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


@register("expert_counts", "torch")
def expert_counts_torch(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (what EPLB balances): topk_ids [num_tokens, top_k] int ->
    [num_experts] int64. Ids outside [0, num_experts), such as -1 slots, are not counted."""
    flat = topk_ids.reshape(-1)
    bins = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # last bin: ignored
    return torch.bincount(bins, minlength=num_experts + 1)[:num_experts]
