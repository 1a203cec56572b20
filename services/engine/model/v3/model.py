"""The DeepSeek-V3 decoder, running over a paged latent KV cache owned by the caller."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.cache_spec import CacheSpec, PagedGroup
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.forward_batch import DecodeQueries, ForwardBatch, GraphStep
from ferry.services.engine.model.moe import MLP, MoE
from ferry.services.engine.model.rope import RotaryEmbedding
from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v3.layers import MLAAttention, RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, placement: ExpertPlacement) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_id):
            self.mlp = MoE(config, config.moe_layer_ids.index(layer_id), placement)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryEmbedding,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it); the next norm adds them."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos_sin, rope, batch, kv_cache)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def decode_in_graph(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryEmbedding,
        rows: torch.Tensor,
        dec: DecodeQueries,
        kv_rows: torch.Tensor,
        blocks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``forward`` for one query per sequence in a captured graph (see
        ``MLAAttention.decode_in_graph``); also returns the MoE's logical choices, which the
        caller counts outside the graph."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.decode_in_graph(h, cos_sin, rope, rows, dec, kv_rows, blocks)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        if not isinstance(self.mlp, MoE):
            return self.mlp(h), residual, None
        weights, ids = self.mlp.route(h, None)
        return self.mlp.apply_experts(h, weights, ids), residual, ids


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, placement: ExpertPlacement) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, placement) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(MoECausalLM):
    """``forward`` maps the new tokens of a batch to final hidden states, writing their latents
    into ``kv_cache``; ``compute_logits`` turns chosen rows of those into float32 logits."""

    config: ModelConfig
    has_decode_graph = True

    def __init__(self, config: ModelConfig, placement: ExpertPlacement | None = None) -> None:
        super().__init__(config, placement)
        self.model = DeepseekV3Model(config, self.placement)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)

    def decoder_layers(self) -> Iterable[nn.Module]:
        return iter(self.model.layers)

    def cache_spec(self) -> CacheSpec:
        """One paged group: a latent (``c_kv ‖ k_rope``) per token on every layer."""
        c = self.config
        return CacheSpec(groups=(PagedGroup("latent", c.num_hidden_layers, 1, c.kv_cache_dim),))

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_slots: int = 0, num_snapshots: int = 0
    ) -> torch.Tensor:
        """A zeroed latent cache: [num_layers, num_blocks, block_size, kv_lora_rank + rope_dim]
        (no state slots: V3 keeps nothing per request)."""
        c = self.config
        shape = (c.num_hidden_layers, num_blocks, block_size, c.kv_cache_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """input_ids: [num_tokens]; kv_cache: [num_layers, num_blocks, block_size, kv_cache_dim].
        Returns the final hidden states [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(batch.positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer_id, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos_sin, self.rope, batch, kv_cache[layer_id])
        assert residual is not None
        x, _ = self.model.norm.add_forward(x, residual)
        return x

    def graph_inputs(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The cache as [tokens, dim] rows: the graph writes into its input itself (through a
        view, it would copy the whole cache)."""
        return (kv_cache.view(-1, kv_cache.shape[-1]),)

    def decode_graph(
        self, step: GraphStep, kv_cache: torch.Tensor, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """``MoECausalLM.decode_graph``: the token's slot and the context length follow from
        its position and block table."""
        (kv_rows,) = inputs
        positions, block_tables, block_size = step.positions, step.block_tables, step.block_size
        dim = kv_rows.shape[-1]
        num_blocks = kv_rows.shape[0] // (self.config.num_hidden_layers * block_size)
        blocks = kv_rows.view(-1, block_size, dim)
        seq_lens = positions + 1
        own_block = block_tables.gather(1, (positions // block_size)[:, None])[:, 0]
        slot_mapping = own_block * block_size + positions % block_size
        x = self.model.embed_tokens(step.input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        routed = []
        layer: DecoderLayer
        for layer_id, layer in enumerate(self.model.layers):  # type: ignore[assignment]
            first = layer_id * num_blocks
            dec = DecodeQueries(torch.empty(0), block_tables + first, seq_lens)
            x, residual, ids = layer.decode_in_graph(
                x,
                residual,
                cos_sin,
                self.rope,
                slot_mapping + first * block_size,
                dec,
                kv_rows,
                blocks,
            )
            if ids is not None:
                routed.append(ids)
        assert residual is not None
        x, _ = self.model.norm.add_forward(x, residual)
        self.count_choices(step, routed, self.config.n_routed_experts)
        return self.compute_logits(x)
