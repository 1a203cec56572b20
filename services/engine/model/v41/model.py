"""The DeepSeek-V4.1 decoder (V4.1-Flash): 4 residual streams mixed by mHC, each sublayer's input
collapsed with the pre-mix its predecessor computed, Engram updates before a few layers, and no
learned hyper-head: the last layer's FFN pre-mix collapses the streams for the final norm and
the head."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.cache_spec import CacheSpec
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.forward_batch import AttentionPath, ForwardBatch
from ferry.services.engine.model.mhc import HyperConnection, V4RMSNorm
from ferry.services.engine.model.rope import V4Rope
from ferry.services.engine.model.v41.config import V41ModelConfig
from ferry.services.engine.model.v41.engram import EngramHash, EngramLayer, EngramParams
from ferry.services.engine.model.v41.kv_cache import V41KVCache, v41_cache_spec
from ferry.services.engine.model.v41.layers import (
    Chunk,
    History,
    Span,
    Step,
    Trace,
    V41Attention,
    V41HyperConnection,
    V41MoE,
)
from ferry.services.engine.model.v41.quant import AUTO, CacheFormat

# Parameters kept in float32 whatever the model's dtype, as the reference keeps them
KEEP_FP32: tuple[str, ...] = (
    *("attn_hc", "ffn_hc", "sinks", "e_score_correction_bias"),
    *(r"markov_head\.head", "confidence_head"),  # DSpark's heads
)


class V41DecoderLayer(nn.Module):
    def __init__(self, config: V41ModelConfig, layer_id: int, mlp: V41MoE) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_id = layer_id
        self.attn_hc = V41HyperConnection(config)
        self.ffn_hc = V41HyperConnection(config)
        self.input_layernorm = V4RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = V4RMSNorm(config.hidden_size, eps)
        self.self_attn = V41Attention(config, layer_id)
        self.mlp = mlp
        self.engram = (
            EngramLayer(engram_params(config), layer_id)
            if layer_id in config.engram_layer_ids
            else None
        )

    def forward(
        self, streams: torch.Tensor, pre_mix: torch.Tensor, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc, hidden], pre_mix [T, hc] (the previous layer's FFN pre-mix) -> the
        streams after attention and MoE, and this layer's FFN pre-mix for the next one."""
        attn_pre, post, comb = self.attn_hc.coefficients(streams)
        x = self.input_layernorm(V41HyperConnection.collapse(streams, pre_mix))
        x = self.self_attn(x, step)
        streams = HyperConnection.expand(streams, x, post, comb)
        ffn_pre, post, comb = self.ffn_hc.coefficients(streams)
        h = self.post_attention_layernorm(V41HyperConnection.collapse(streams, attn_pre))
        weights, ids = self.mlp.route(h, None)
        if self.mlp.expert_load is not None:
            self.mlp.expert_load.add(self.mlp.moe_layer, ids)
        for span in step.spans:
            if span.trace is not None:
                span.trace.experts[self.layer_id] = ids[span.rows].sort(dim=-1).values
        x = self.mlp.apply_experts(h, weights, ids)
        return HyperConnection.expand(streams, x, post, comb), ffn_pre


class DSparkStage(V41DecoderLayer):
    """One stage of the DSpark drafter (``mtp.{k}`` in DeepSeek's checkpoint): a window-only
    block with an MoE of its own (``dspark_n_routed_experts``, every one on every rank), the
    first stage projecting the target's taps (``main_proj``, ``main_norm``), the last one the
    final norm, the Markov head (a bigram bias on the drafts' logits) and the confidence head.
    Loaded with the model; speculative decoding runs it."""

    def __init__(self, config: V41ModelConfig, stage: int) -> None:
        experts = config.dspark_n_routed_experts or config.n_routed_experts
        moe = dataclasses.replace(
            config,
            n_routed_experts=experts,
            num_experts_per_tok=config.dspark_num_experts_per_tok or config.num_experts_per_tok,
        )
        with torch.device("cpu"):  # real tensors, also while the loader builds on "meta"
            placement = ExpertPlacement.identity(1, experts)
        super().__init__(config, config.num_hidden_layers + stage, V41MoE(moe, 0, placement))
        h, rank = config.hidden_size, config.dspark_markov_rank
        if stage == 0:
            taps = len(config.dspark_target_layer_ids)
            self.main_proj = nn.Linear(taps * h, h, bias=False)
            self.main_norm = V4RMSNorm(h, config.rms_norm_eps)
        if stage == config.num_nextn_predict_layers - 1:
            self.norm = V4RMSNorm(h, config.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(config.vocab_size, rank)
            self.markov_head.head = nn.Linear(rank, config.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(h + rank, 1, bias=False)


class DeepseekV41Model(nn.Module):
    def __init__(self, config: V41ModelConfig, placement: ExpertPlacement) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            V41DecoderLayer(config, i, V41MoE(config, i, placement))
            for i in range(config.num_hidden_layers)
        )
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        stages = config.num_nextn_predict_layers if config.dspark_block_size else 0
        self.dspark = nn.ModuleList(DSparkStage(config, k) for k in range(stages))


class DeepseekV41ForCausalLM(MoECausalLM):
    """``forward`` runs the engine's batch over its cache; ``forward_chunk`` one sequence's
    next tokens after what its ``History`` holds (the engine's cache, or a ``SequenceState``);
    ``compute_logits`` turns final hidden states into float32 logits. Engram needs the
    tokenizer's compressed token map, read with the weights (``attach_checkpoint_files``)."""

    config: V41ModelConfig
    keep_fp32: tuple[str, ...] = KEEP_FP32
    attention_path: AttentionPath = "expanded"  # one path for every sequence, decode included

    def __init__(self, config: V41ModelConfig, placement: ExpertPlacement | None = None) -> None:
        super().__init__(config, placement)
        self.model = DeepseekV41Model(config, self.placement)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = V4Rope(config)  # type: ignore[arg-type]
        self.hasher: EngramHash | None = None
        self.cache_format = AUTO
        # a ratio-2 source pools in float32, its two projections too (the reference's choice)
        pooled = "|".join(str(i) for i in config.kv_source_layer_ids if config.ratio(i) == 2)
        if pooled:
            self.keep_fp32 = (
                *KEEP_FP32,
                rf"layers\.({pooled})\.self_attn\.compressor\.(kv|gate)_proj",
            )

    def decoder_layers(self) -> Iterable[nn.Module]:
        return iter(self.model.layers)

    def set_kv_cache_dtype(self, name: str) -> None:
        self.cache_format = CacheFormat(name)

    def cache_spec(self) -> CacheSpec:
        return v41_cache_spec(self.config, self.cache_format)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_slots: int, num_snapshots: int = 0
    ) -> V41KVCache:
        return V41KVCache(
            self.config,
            self.cache_format,
            num_blocks,
            block_size,
            num_slots,
            self.dtype,
            self.device,
            num_snapshots,
        )

    def kv_blocks(self, kv_cache: V41KVCache) -> torch.Tensor:
        return kv_cache.transfer

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: V41KVCache
    ) -> torch.Tensor:
        """input_ids [num_tokens]: each sequence of ``batch`` continues from its blocks and
        state slot, all in one step (a DEP rank's MoE layers exchange tokens once a step); a
        block boundary the prefix cache snapshots is written as the layers pass it. Returns
        the final hidden states [num_tokens, hidden]."""
        if batch.decode is not None:
            raise ValueError("DeepSeek-V4.1 runs every sequence on the expanded path")
        chunks = []
        for span in batch.prefill:
            if span.state_slot < 0:
                raise ValueError("a DeepSeek-V4.1 sequence needs a state slot")
            start = span.ctx_len - (span.q_end - span.q_start)
            history = kv_cache.history(span.state_slot, span.block_ids, start, span.snapshots)
            chunks.append((input_ids[span.q_start : span.q_end], history))
        return self.forward_sequences(chunks)

    def attach_checkpoint_files(self, path: Path) -> None:
        """Engram's compressed token map comes from the checkpoint's tokenizer.json."""
        if not self.config.engram_layer_ids:
            return
        tokenizer = path / "tokenizer.json"
        if not tokenizer.exists():
            raise ConfigError(f"{path}: DeepSeek-V4.1's Engram needs its tokenizer.json")
        hasher = EngramHash.from_tokenizer(engram_params(self.config), tokenizer)
        self.hasher = hasher.to(self.device)

    def forward_chunk(
        self, input_ids: torch.Tensor, state: History, trace: Trace | None = None
    ) -> torch.Tensor:
        """input_ids [T]: the sequence's tokens at ``state.length`` onwards. Returns the final
        hidden states [T, hidden]; ``state`` then holds them too."""
        return self.forward_sequences([(input_ids, state)], [trace])

    def forward_sequences(
        self,
        chunks: Sequence[tuple[torch.Tensor, History]],
        traces: list[Trace | None] | None = None,
    ) -> torch.Tensor:
        """Chunks of several sequences as one step, each [T_i] tokens at its history's length
        onwards: the final hidden states of all of them, one after another [sum T_i, hidden]."""
        c = self.config
        spans, hashes, at = [], [], 0
        for i, (ids, state) in enumerate(chunks):
            start = state.length
            state.begin(len(ids))
            positions = torch.arange(start, start + len(ids), device=ids.device)
            chunk = Chunk(positions, self.rope, self.cache_format)
            trace = traces[i] if traces else None
            spans.append(Span(slice(at, at + len(ids)), chunk, state, trace=trace))
            at += len(ids)
            if c.engram_layer_ids:
                hashes.append(self._engram_hashes(ids, state))
        input_ids = torch.cat([ids for ids, _ in chunks])
        whole = torch.cat([s.chunk.positions for s in spans])
        step = Step(spans, Chunk(whole, self.rope, self.cache_format))
        engram = torch.cat(hashes) if hashes else None
        streams = self.model.embed_tokens(input_ids)[:, None, :]
        streams = streams.expand(-1, c.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(len(input_ids), c.hc_mult, device=input_ids.device)
        pre_mix[:, 0] = 1.0  # the first sublayer takes stream 0
        layer: V41DecoderLayer
        for layer in self.model.layers:  # type: ignore[assignment]
            if layer.engram is not None:
                assert engram is not None
                streams = layer.engram(streams, engram[:, layer.engram.hash_index])
            streams, pre_mix = layer(streams, pre_mix, step)
            for span in spans:
                if span.trace is not None:
                    span.trace.block_out[layer.layer_id] = streams[span.rows]
        for span in spans:
            span.state.end()
        return self.model.norm(V41HyperConnection.collapse(streams, pre_mix))

    def _engram_hashes(self, input_ids: torch.Tensor, state: History) -> torch.Tensor:
        """The chunk's Engram rows ([T, layers, columns]), its look-back carried in ``state``."""
        if self.hasher is None:
            raise RuntimeError("DeepSeek-V4.1's Engram needs the tokenizer: load a checkpoint")
        lookback = state.engram_lookback()
        if lookback is None:
            lookback = self.hasher.start_lookback()
        hashes, after = self.hasher.extend(lookback, input_ids)
        state.keep_engram_lookback(after)
        if state.snapshots:  # the look-back at a position: the ids of the tokens before it
            seen = torch.cat([lookback, self.hasher.compress(input_ids)])
            for position, snapshot in state.snapshots:
                at = position - state.length
                state.snapshot_engram_lookback(snapshot, seen[at : at + len(lookback)])
        return hashes

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.lm_head.weight.float())


def engram_params(c: V41ModelConfig) -> EngramParams:
    names = {f.name for f in dataclasses.fields(EngramParams)}
    return EngramParams(**{n: getattr(c, n) for n in names})
