"""Building blocks of the DeepSeek-V3 decoder: RMSNorm and MLA attention (the dense MLP and
DeepSeekMoE, which V4 shares, are in ``model/moe.py``). Parameter names follow the HF checkpoints
(``self_attn.kv_a_proj_with_mqa`` ...).
"""

from __future__ import annotations

import torch
from torch import nn

from ferry import kernels as ops
from ferry.services.engine.model.forward_batch import DecodeQueries, ForwardBatch, PrefillSpan
from ferry.services.engine.model.rope import RotaryEmbedding
from ferry.services.engine.model.v3.config import ModelConfig

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
