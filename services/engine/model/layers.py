"""Building blocks of the DeepSeek-V3 decoder: RMSNorm, dense MLP, MLA attention, DeepSeekMoE.

Parameter names follow the HF checkpoints (``self_attn.kv_a_proj_with_mqa`` ...), except the routed
experts, which are stacked per physical slot (``experts.w13``, ``experts.w2``); the loader maps
``experts.{e}.{gate,up,down}_proj`` onto them through the ExpertPlacement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ferry import kernels as ops
from ferry.kernels.fused_moe.reference import swiglu
from ferry.services.engine.expert_load import ExpertLoad
from ferry.services.engine.expert_parallel import EPGroup, combine, dispatch
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.config import ModelConfig
from ferry.services.engine.model.forward_batch import DecodeQueries, ForwardBatch, PrefillSpan
from ferry.services.engine.model.rope import RotaryEmbedding

# DeepSeek's q/kv latent norms use a fixed eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class MLP(nn.Module):
    """SiLU-gated MLP: the dense layers and the shared experts (DeepSeek-V4's clamped at
    ``swiglu_limit``)."""

    def __init__(self, hidden: int, inter: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class MLAAttention(nn.Module):
    """Multi-head latent attention over a paged cache of ``c_kv ‖ k_rope`` latents."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.kv_lora_rank = c.kv_lora_rank
        self.softmax_scale = c.softmax_scale
        q_out = self.num_heads * c.qk_head_dim
        self.q_lora = c.q_lora_rank is not None
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_cache_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryEmbedding,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [num_tokens, hidden]; kv_cache: [num_blocks, block_size, kv_cache_dim] of this layer,
        written at ``batch.slot_mapping`` before it is read."""
        num_tokens = x.shape[0]
        q_nope, q_rope, latent = self.project(x, cos_sin, rope)
        kv_cache.view(-1, latent.shape[-1])[batch.slot_mapping] = latent.to(kv_cache.dtype)

        out = x.new_empty(num_tokens, self.num_heads, self.v_dim)
        for span in batch.prefill:
            rows = slice(span.q_start, span.q_end)
            out[rows] = self._expanded(q_nope[rows], q_rope[rows], kv_cache, span)
        if batch.decode is not None:
            idx = batch.decode.token_index
            out[idx] = self._absorbed(q_nope[idx], q_rope[idx], kv_cache, batch.decode)
        return self.o_proj(out.view(num_tokens, -1))

    def project(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, heads, nope], q_rope [T, heads, rope] rotated, the latent to cache
        [T, kv_cache_dim])."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = cos_sin
        q_rope = rope.apply(q_rope, cos, sin)
        k_rope = rope.apply(k_rope[:, None, :], cos, sin)[:, 0]
        return q_nope, q_rope, torch.cat((self.kv_a_layernorm(c_kv), k_rope), dim=-1)

    def decode_in_graph(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryEmbedding,
        rows: torch.Tensor,
        dec: DecodeQueries,
        kv_rows: torch.Tensor,
        blocks: torch.Tensor,
    ) -> torch.Tensor:
        """One query per sequence (``forward``'s absorbed path) in a captured graph: ``kv_rows``
        is every layer's cache as [tokens, dim] rows, ``rows`` this step's latents' rows in it,
        ``blocks`` the same memory as [layers * num_blocks, block_size, dim], and
        ``dec.block_tables`` already offset to this layer's blocks."""
        q_nope, q_rope, latent = self.project(x, cos_sin, rope)
        kv_rows[rows] = latent.to(kv_rows.dtype)
        out = self._absorbed(q_nope, q_rope, blocks, dec)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        latent = kv_cache[span.block_ids].view(-1, kv_cache.shape[-1])[: span.ctx_len]
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(span.ctx_len, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        # [heads, len, dim] views for the attention op; output [q_len, heads, v_dim]
        return ops.prefill_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.softmax_scale
        )

    def _absorbed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, dec: DecodeQueries
    ) -> torch.Tensor:
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank
        )
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)  # [B, heads, kv_lora_rank]
        q = torch.cat((q_latent, q_rope), dim=-1)  # [B, heads, kv_cache_dim]
        o_latent = ops.mla_decode(
            q, kv_cache, dec.block_tables, dec.seq_lens, self.softmax_scale, self.kv_lora_rank
        )
        return torch.einsum("bhl,hvl->bhv", o_latent, w_uv)  # [B, heads, v_dim]


class Router(nn.Module):
    """The MoE gate. Kept in float32, as DeepSeek runs it, whatever the model's dtype."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor
        bias = torch.zeros(num_experts, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", bias)


class HashRouter(nn.Module):
    """A hash-MoE layer's gate (DeepSeek-V4): the experts come from ``tid2eid[token id]``,
    fixed; the learned ``weight`` only scores them. Nothing steers it: no bias."""

    def __init__(self, num_experts: int, hidden: int, vocab_size: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.tid2eid: torch.Tensor
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))


class RoutedExperts(nn.Module):
    """The routed experts held on this rank, one row per physical slot."""

    def __init__(self, num_slots: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * inter, hidden))  # gate rows, up rows
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden, inter))


class MoE(nn.Module):
    """DeepSeekMoE: group-limited top-k routed experts plus always-on shared experts.
    Subclasses change how tokens are routed (``route``) and the SwiGLU clamp."""

    swiglu_limit: float | None = None

    def __init__(self, config: ModelConfig, moe_layer: int, placement: ExpertPlacement) -> None:
        super().__init__()
        self.config = config
        self.moe_layer = moe_layer  # index among MoE layers (the placement's row)
        self.placement = placement
        self.gate: Router | HashRouter = Router(config.n_routed_experts, config.hidden_size)
        inter = config.moe_intermediate_size
        self.experts = RoutedExperts(placement.slots_per_rank, config.hidden_size, inter)
        self.ep_group: EPGroup | None = None  # set by attach_ep_group on a DEP rank
        self.expert_load: ExpertLoad | None = None  # set by attach_expert_load
        # the routed experts of up to ``small_batch[0]`` tokens as one fused kernel, where the
        # engine compiled it (piece_graphs.py): (most tokens, compiled fused_moe_gathered)
        self.small_batch: tuple[int, Callable[..., torch.Tensor]] | None = None
        self.shared_experts = (
            MLP(config.hidden_size, inter * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    @property
    def correction_bias(self) -> torch.Tensor | None:
        """The bias that steers which experts are picked (None where nothing can)."""
        return self.gate.e_score_correction_bias if isinstance(self.gate, Router) else None

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, logical expert ids [T, top_k] int64)."""
        c = self.config
        logits = F.linear(x.float(), self.gate.weight)  # [T, n_routed_experts] float32
        return ops.moe_route(
            logits,
            self.correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden]; input_ids: [T], for layers that route by token id."""
        weights, ids = self.route(x, input_ids)
        if self.expert_load is not None:
            self.expert_load.add(self.moe_layer, ids)
        return self.apply_experts(x, weights, ids)

    def apply_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts ``route`` chose (logical ``ids``), plus the shared ones."""
        slots = self.placement.select_slots(self.moe_layer, ids)
        limit = self.swiglu_limit
        w13, w2 = self.experts.w13, self.experts.w2
        if self.ep_group is None:
            if self.small_batch and x.shape[0] <= self.small_batch[0]:
                out = self.small_batch[1](x, w13, w2, weights, slots)
            else:
                out = ops.fused_moe(x, w13, w2, weights, slots, limit)
        else:  # the slots live on several ranks: send the rows there and back
            d = dispatch(x, slots, weights, self.placement.slots_per_rank, self.ep_group)
            if self.expert_load is not None:
                self.expert_load.add_rows(self.moe_layer, d.hidden.shape[0])
            y = ops.fused_moe(d.hidden, w13, w2, d.weights[:, None], d.local_slots[:, None], limit)
            out = combine(y, d, self.ep_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
