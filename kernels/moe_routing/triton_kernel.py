"""DeepSeek-V3 routing in one Triton program per block of tokens, and per-expert token counts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import register
from ferry.kernels.moe_routing.reference import SCORING_FUNCS
from ferry.kernels.triton_common import empty, next_pow2

BLOCK_T = 16  # tokens per program


@triton.jit
def _keep_top_groups(
    choice,
    experts,
    group_size,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """choice: [BLOCK_T, BLOCK_E] biased scores (-inf where no expert). Groups are ranked by the
    sum of their two best scores; experts outside the TOPK_GROUP best groups become -inf."""
    groups = tl.arange(0, BLOCK_G)
    group_of = experts // group_size  # [BLOCK_E]; padding experts fall past the last group
    group_scores = tl.full([choice.shape[0], BLOCK_G], float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        in_group = tl.where((group_of == g)[None, :], choice, float("-inf"))
        best_at = tl.argmax(in_group, axis=1)
        best = tl.max(in_group, axis=1)
        second = tl.max(tl.where(experts[None, :] == best_at[:, None], float("-inf"), in_group), 1)
        group_scores = tl.where(groups[None, :] == g, (best + second)[:, None], group_scores)
    eligible = tl.zeros(choice.shape, tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(group_scores, axis=1)  # [BLOCK_T]
        eligible = eligible | (group_of[None, :] == g[:, None])
        group_scores = tl.where(groups[None, :] == g[:, None], float("-inf"), group_scores)
    return tl.where(eligible, choice, float("-inf"))


@triton.jit
def _moe_route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    logits_stride,
    routed_scaling_factor,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCORING: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Route BLOCK_T tokens as :func:`kernels.moe_routing.reference.moe_route_torch` does.

    logits: [num_tokens, num_experts] float32; bias: [num_experts] float32 (if HAS_BIAS).
    weights: [num_tokens, TOP_K] float32 (contiguous); ids: [num_tokens, TOP_K] int64, in
    descending order of biased score.
    """
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    t_mask, e_mask = tokens < num_tokens, experts < num_experts
    rows = tokens.to(tl.int64)[:, None]
    logits = tl.load(
        logits_ptr + rows * logits_stride + experts[None, :],
        mask=t_mask[:, None] & e_mask[None, :],
        other=0.0,
    )
    if SCORING == 0:  # sigmoid
        scores = tl.sigmoid(logits)  # [BLOCK_T, BLOCK_E]
    elif SCORING == 1:  # sqrt(softplus), torch's softplus: linear past 20
        scores = tl.sqrt(tl.where(logits > 20.0, logits, tl.log(1.0 + tl.exp(logits))))
    else:  # softmax over the experts
        masked = tl.where(e_mask[None, :], logits, float("-inf"))
        e = tl.exp(masked - tl.max(masked, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=e_mask, other=0.0)[None, :]
    choice = tl.where(e_mask[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        choice = _keep_top_groups(
            choice, experts, num_experts // N_GROUP, N_GROUP, TOPK_GROUP, BLOCK_G
        )

    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)  # [BLOCK_T]
        hit = experts[None, :] == best[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # the unbiased score
        weights = tl.where(ks[None, :] == k, weight[:, None], weights)
        ids = tl.where(ks[None, :] == k, best[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * routed_scaling_factor

    out = rows * TOP_K + ks[None, :]
    out_mask = t_mask[:, None] & (ks < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)


@register("moe_route", "triton")
def moe_route_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, num_experts] float32 -> (weights [T, top_k] float32,
    ids [T, top_k] int64). See moe_route_torch."""
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r}: one of {', '.join(SCORING_FUNCS)}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = empty((num_tokens, top_k), torch.float32, logits.device)
    ids = empty((num_tokens, top_k), torch.int64, logits.device)
    if num_tokens == 0:
        return weights, ids
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    _moe_route_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        logits,
        bias,
        weights,
        ids,
        num_tokens,
        num_experts,
        logits.stride(0),
        routed_scaling_factor,
        HAS_BIAS=correction_bias is not None,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        SCORING=SCORING_FUNCS.index(scoring_func),
        BLOCK_T=BLOCK_T,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_G=next_pow2(n_group),
        BLOCK_K=next_pow2(top_k),
    )
    return weights, ids


@triton.jit
def _expert_counts_kernel(
    ids_ptr, counts_ptr, n, num_experts, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr
):
    """counts[e] += #{i in this program's BLOCK of ids : ids[i] == e}; ids outside
    [0, num_experts) are ignored. counts: [num_experts] int32, zeroed by the caller."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    hist = tl.histogram(tl.where(valid, ids, 0).to(tl.int32), BLOCK_E, mask=valid)
    experts = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + experts, hist, mask=experts < num_experts)


@register("expert_counts", "triton")
def expert_counts_triton(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids: [num_tokens, top_k] int -> [num_experts] int64 tokens routed to each expert."""
    flat = topk_ids.reshape(-1).contiguous()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device)
    if flat.numel():
        block = 1024
        _expert_counts_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, counts, flat.numel(), num_experts, BLOCK=block, BLOCK_E=next_pow2(num_experts)
        )
    return counts.to(torch.int64)
