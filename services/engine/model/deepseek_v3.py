"""The DeepSeek-V3 decoder, running over a paged latent KV cache owned by the caller."""

from __future__ import annotations

import torch
from torch import nn

from ferry.services.engine.expert_load import ExpertLoad
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.config import ModelConfig
from ferry.services.engine.model.forward_batch import ForwardBatch
from ferry.services.engine.model.layers import MLP, MLAAttention, MoE, RMSNorm
from ferry.services.engine.model.rope import RotaryEmbedding


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


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, placement: ExpertPlacement) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, placement) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """``forward`` maps the new tokens of a batch to final hidden states, writing their latents
    into ``kv_cache``; ``compute_logits`` turns chosen rows of those into float32 logits."""

    def __init__(self, config: ModelConfig, placement: ExpertPlacement | None = None) -> None:
        super().__init__()
        if placement is None:
            placement = ExpertPlacement.identity(config.num_moe_layers, config.n_routed_experts)
        if placement.num_moe_layers != config.num_moe_layers:
            raise ValueError(
                f"placement covers {placement.num_moe_layers} MoE layers, model has {config.num_moe_layers}"
            )
        self.config = config
        self.placement = placement
        self.model = DeepseekV3Model(config, placement)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)

    def attach_ep_group(self, group: EPGroup) -> None:
        """Make this model a rank of a DEP group: its MoE layers exchange tokens with the other
        ranks (the placement must say the same ep_size and ep_rank)."""
        p = self.placement
        if (p.ep_size, p.ep_rank) != (group.size, group.rank):
            raise ValueError(
                f"placement is rank {p.ep_rank} of {p.ep_size}, the group says "
                f"rank {group.rank} of {group.size}"
            )
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.ep_group = group

    def attach_expert_load(self, load: ExpertLoad) -> None:
        """Count every MoE layer's routing into ``load``."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.expert_load = load

    def skew_routing(self, skew: float) -> None:
        """A test knob: add a seeded ``skew * N(0, 1)`` per expert to every MoE layer's
        correction bias, which steers which experts the router picks (not their weights), so
        that a few experts get most tokens, as in real traffic. The same in every process."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                gen = torch.Generator().manual_seed(1000 + layer.mlp.moe_layer)
                bias = layer.mlp.gate.e_score_correction_bias
                bias += skew * torch.randn(bias.shape, generator=gen).to(bias.device)

    def idle_moe_pass(self) -> None:
        """A DEP rank with nothing to run this step: join every MoE layer's exchange with no
        tokens, in layer order, so that the other ranks' steps can complete."""
        empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp(empty)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed latent cache: [num_layers, num_blocks, block_size, kv_lora_rank + rope_dim]."""
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab_size] float32."""
        return self.lm_head(hidden).float()
