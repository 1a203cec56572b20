"""The DeepSeek-V4 decoder (V4-Flash, -Base): 4 residual streams mixed by mHC around every
attention and MoE sublayer, then a hyper-head collapses them for the final norm and lm_head."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.cache_spec import CacheSpec
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.forward_batch import AttentionPath, ForwardBatch, GraphStep
from ferry.services.engine.model.mhc import HyperConnection, V4RMSNorm
from ferry.services.engine.model.rope import V4Rope
from ferry.services.engine.model.v4.compressors import DecodeStep, Sequence, V4Batch
from ferry.services.engine.model.v4.config import V4ModelConfig
from ferry.services.engine.model.v4.kv_cache import (
    DecodeLayerCache,
    LayerCache,
    V4KVCache,
    v4_cache_spec,
)
from ferry.services.engine.model.v4.layers import HyperHead, V4Attention, V4MoE

# Parameters kept in float32 whatever the model's dtype, as transformers keeps them (its
# `_keep_in_fp32_modules_strict`): a parameter whose dotted name holds one of these parts.
KEEP_FP32 = (
    "attn_hc",
    "ffn_hc",
    "hc_head",
    "sinks",
    "position_bias",
    "e_score_correction_bias",
    "q_a_norm",
    "kv_norm",
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
)


class V4DecoderLayer(nn.Module):
    def __init__(self, config: V4ModelConfig, layer_id: int, placement: ExpertPlacement) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        self.input_layernorm = V4RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = V4RMSNorm(config.hidden_size, eps)
        self.self_attn = V4Attention(config, layer_id)
        self.mlp = V4MoE(config, layer_id, placement)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: V4Batch,
        cache: LayerCache,
        rope: V4Rope,
    ) -> torch.Tensor:
        """streams: [T, hc_mult, hidden] -> the same, after attention and MoE."""
        post, comb, x = self.attn_hc(streams)
        x = self.self_attn(self.input_layernorm(x), positions, batch, cache, rope)
        streams = HyperConnection.expand(streams, x, post, comb)
        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x), input_ids)
        return HyperConnection.expand(streams, x, post, comb)

    def decode_in_graph(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        step: DecodeStep,
        cache: DecodeLayerCache,
        rope: V4Rope,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` for one token per sequence in a captured graph; also returns a learned
        MoE layer's logical choices, which the caller counts (None for a hash-routed one)."""
        post, comb, x = self.attn_hc(streams)
        x = self.self_attn.decode(self.input_layernorm(x), step, cache, rope)
        streams = HyperConnection.expand(streams, x, post, comb)
        post, comb, x = self.ffn_hc(streams)
        h = self.post_attention_layernorm(x)
        weights, ids = self.mlp.route(h, input_ids)
        x = self.mlp.apply_experts(h, weights, ids)
        return HyperConnection.expand(streams, x, post, comb), None if self.mlp.hashed else ids


class DeepseekV4Model(nn.Module):
    def __init__(self, config: V4ModelConfig, placement: ExpertPlacement) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, i, placement) for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4ForCausalLM(MoECausalLM):
    """``forward`` maps the new tokens of a batch to final hidden states, reading and extending
    each sequence's cache (its blocks and its state slot); ``compute_logits`` turns chosen rows
    of those into float32 logits."""

    config: V4ModelConfig
    has_decode_graph = True

    # every sequence takes the one path (window ∪ compressed entries, sinks), decode included
    attention_path: AttentionPath = "expanded"
    keep_fp32 = KEEP_FP32

    def __init__(self, config: V4ModelConfig, placement: ExpertPlacement | None = None) -> None:
        super().__init__(config, placement)
        self.model = DeepseekV4Model(config, self.placement)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = V4Rope(config)

    def decoder_layers(self) -> Iterable[nn.Module]:
        return iter(self.model.layers)

    def cache_spec(self) -> CacheSpec:
        return v4_cache_spec(self.config)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_slots: int, num_snapshots: int = 0
    ) -> V4KVCache:
        """A zeroed cache: ``num_blocks`` paged blocks, ``num_slots`` state slots and
        ``num_snapshots`` snapshots of them."""
        c = self.config
        return V4KVCache(
            c, num_blocks, block_size, num_slots, self.dtype, self.device, num_snapshots
        )

    def kv_blocks(self, kv_cache: V4KVCache) -> torch.Tensor:
        return kv_cache.transfer

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: V4KVCache
    ) -> torch.Tensor:
        """input_ids: [num_tokens]; every sequence of ``batch`` on the expanded path with its
        state slot. Returns the final hidden states [num_tokens, hidden]."""
        parts = V4Batch.of(_sequences(batch))
        streams = self.model.embed_tokens(input_ids)[:, None, :]
        streams = streams.expand(-1, self.config.hc_mult, -1).contiguous()
        for layer_id, layer in enumerate(self.model.layers):
            cache = kv_cache.layer(layer_id)
            streams = layer(streams, input_ids, batch.positions, parts, cache, self.rope)
        return self.model.norm(self.model.hc_head(streams))

    def graph_inputs(self, kv_cache: V4KVCache) -> tuple[torch.Tensor, ...]:
        return kv_cache.graph_inputs()

    def decode_graph(
        self, step: GraphStep, kv_cache: V4KVCache, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """``MoECausalLM.decode_graph``: each sequence reads and extends its state slot
        (``step.slots``) and its blocks. Snapshots of the slots are the caller's, after."""
        layers = kv_cache.decode_layers(inputs)
        rows = torch.arange(step.input_ids.shape[0], device=step.input_ids.device)
        dec = DecodeStep(rows, step.positions, step.slots, step.block_tables, [])
        streams = self.model.embed_tokens(step.input_ids)[:, None, :]
        streams = streams.expand(-1, self.config.hc_mult, -1).contiguous()
        routed = []
        layer: V4DecoderLayer
        for layer_id, layer in enumerate(self.model.layers):  # type: ignore[assignment]
            streams, ids = layer.decode_in_graph(
                streams, step.input_ids, dec, layers[layer_id], self.rope
            )
            routed.append(ids)
        self.count_choices(step, routed, self.config.n_routed_experts)
        return self.compute_logits(self.model.norm(self.model.hc_head(streams)))


def _sequences(batch: ForwardBatch) -> list[Sequence]:
    if batch.decode is not None:
        raise ValueError("DeepSeek-V4 runs every sequence on the expanded path")
    seqs = []
    for s in batch.prefill:
        if s.state_slot < 0:
            raise ValueError("a DeepSeek-V4 sequence needs a state slot")
        n = s.q_end - s.q_start
        seqs.append(
            Sequence(
                slice(s.q_start, s.q_end),
                batch.positions[s.q_start : s.q_end],
                s.ctx_len - n,
                s.block_ids,
                s.state_slot,
                s.snapshots,
            )
        )
    return seqs
