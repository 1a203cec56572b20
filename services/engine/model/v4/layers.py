"""Building blocks of the DeepSeek-V4 decoder, as transformers' ``DeepseekV4ForCausalLM`` computes
them (the parity oracle): mHC hyper-connections with Sinkhorn, shared-KV MQA with attention sinks
over a sliding window plus compressed entries (CSA: overlapping windows chosen by the lightning
indexer; HCA: long windows, all attended), the grouped output projection, and hash-routed or
sqrt(softplus)-routed MoE with the SwiGLU clamp.

Parameter names follow the HF checkpoints (``self_attn.compressor.indexer.q_b_proj`` ...); the
routed experts are stacked per physical slot, as for V3.

Every sequence continues from its cache (``kv_cache``): the window's rows and the compressors'
open rows in its state slot, the compressed entries in its blocks; the compressors and the
indexer are in ``compressors``. Prefill chunks, ending anywhere, run one sequence at a time;
decode tokens run as one batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry import kernels as ops
from ferry.kernels.moe_routing.reference import expert_scores
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.mhc import GroupedLinear, V4RMSNorm
from ferry.services.engine.model.moe import MLP, HashRouter, MoE, Router
from ferry.services.engine.model.rope import V4Rope
from ferry.services.engine.model.v4.compressors import (
    Compressor,
    CSACompressor,
    DecodeStep,
    HCACompressor,
    Sequence,
    V4Batch,
    ring_keep,
    ring_rows,
)
from ferry.services.engine.model.v4.config import CSA, HCA, V4ModelConfig
from ferry.services.engine.model.v4.kv_cache import DecodeLayerCache, LayerCache

# ---- mHC ------------------------------------------------------------------------------------


class HyperHead(nn.Module):
    """Collapses the streams once, after the last layer (``pre`` only)."""

    def __init__(self, config: V4ModelConfig) -> None:
        super().__init__()
        hc = config.hc_mult
        self.eps = config.hc_eps
        self.norm = V4RMSNorm(hc * config.hidden_size, config.rms_norm_eps, weight=False)
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * config.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(self.norm(streams.flatten(1).float()), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ---- attention ------------------------------------------------------------------------------


class V4Attention(nn.Module):
    """Shared-KV multi-query attention with per-head sinks. Every layer sees a sliding window of
    its own rotated K = V rows; CSA and HCA layers also see their compressed entries in the same
    softmax. The output's rope dims are rotated back (V carried the keys' rotation), then the
    grouped output projection."""

    def __init__(self, config: V4ModelConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.kind = c.layer_types[layer_id]
        self.table = "main" if self.kind not in (CSA, HCA) else "compress"
        self.heads, self.head_dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.o_groups = c.o_groups
        self.softmax_scale = c.head_dim**-0.5
        eps = c.rms_norm_eps
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(c.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.q_norm = V4RMSNorm(self.head_dim, eps, weight=False)
        self.kv_proj = nn.Linear(c.hidden_size, self.head_dim, bias=False)
        self.kv_norm = V4RMSNorm(self.head_dim, eps)
        in_per_group = self.heads * self.head_dim // c.o_groups
        self.o_a_proj = GroupedLinear(in_per_group, c.o_groups * c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.heads))
        self.compressor: Compressor | None = None
        if self.kind == CSA:
            self.compressor = CSACompressor(config)
        elif self.kind == HCA:
            self.compressor = HCACompressor(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: V4Batch,
        cache: LayerCache,
        rope: V4Rope,
    ) -> torch.Tensor:
        """x: [T, hidden] (the normed block input) -> [T, hidden]; reads and extends each
        sequence's part of this layer's ``cache``."""
        q, kv, q_residual, cos, sin = self._project(x, positions, rope)
        out = torch.empty_like(q)
        step = batch.decode
        if step is not None:  # decode tokens: one batched pass
            i = step.rows
            assert cache.decode is not None
            out[i] = self._decode(q[i], x[i], kv[i], q_residual[i], step, cache.decode, rope)
            for slot, snap in step.snapshots:
                cache.save(slot, snap)
        for seq in batch.chunks:  # prefill chunks, one at a time
            for piece, snapshot in seq.pieces():
                r = piece.rows
                keys, seen = self._context(x[r], kv[r], q_residual[r], piece, cache, rope)
                out[r] = ops.sparse_mqa(q[r], keys, _indices(seen), self.sinks, self.softmax_scale)
                if snapshot is not None:
                    cache.save(piece.slot, snapshot)
        return self._output(out, cos, sin)

    def decode(
        self, x: torch.Tensor, step: DecodeStep, cache: DecodeLayerCache, rope: V4Rope
    ) -> torch.Tensor:
        """``forward`` for a batch of decode tokens only, as a graph holds it (no snapshots:
        the caller takes them after the step)."""
        q, kv, q_residual, cos, sin = self._project(x, step.positions, rope)
        out = self._decode(q, x, kv, q_residual, step, cache, rope)
        return self._output(out, cos, sin)

    def _project(
        self, x: torch.Tensor, positions: torch.Tensor, rope: V4Rope
    ) -> tuple[torch.Tensor, ...]:
        """(rotated queries [T, heads, head_dim], rotated K = V rows [T, head_dim], the
        queries' low-rank residual, cos, sin)."""
        n = x.shape[0]
        cos, sin = rope.cos_sin(positions, self.table, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_norm(self.q_b_proj(q_residual).view(n, self.heads, self.head_dim))
        q = V4Rope.rotate(q, cos, sin)
        kv = V4Rope.rotate(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]
        return q, kv, q_residual, cos, sin

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = V4Rope.rotate(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.view(out.shape[0], self.o_groups, -1)))

    def _context(
        self,
        x: torch.Tensor,
        kv: torch.Tensor,
        q_residual: torch.Tensor,
        seq: Sequence,
        cache: LayerCache,
        rope: V4Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys a sequence's queries may read, [window rows | compressed entries], and
        which each query reads [n, keys] (its window; the entries it sees, or that its indexer
        chose)."""
        done, n, positions = seq.done, x.shape[0], seq.positions
        ring = cache.swa[seq.slot]
        first = max(0, done - self.window + 1)
        window = torch.cat((ring_rows(ring, first, done), kv.to(ring.dtype)))
        ring_keep(ring, done, kv)
        dist = positions[:, None] - torch.arange(first, done + n, device=x.device)[None, :]
        seen = (dist >= 0) & (dist < self.window)  # the last `window` tokens, itself included
        if self.compressor is None:
            return window, seen
        assert cache.compressor is not None
        entries = self.compressor.entries(x, seq, cache.compressor, rope)
        visible = self.compressor.visible(positions, entries.shape[0])
        if isinstance(self.compressor, CSACompressor):
            assert cache.indexer is not None
            indexer = self.compressor.indexer
            picks = indexer.pick(x, q_residual, seq, cache.indexer, rope)
            spare = entries.shape[0]  # a column the -1 picks land in, then dropped
            chosen = torch.zeros(n, spare + 1, dtype=torch.bool, device=x.device)
            chosen.scatter_(1, torch.where(picks >= 0, picks, spare), True)
            visible = chosen[:, :spare]
        return torch.cat((window, entries)), torch.cat((seen, visible), dim=1)

    def _decode(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        kv: torch.Tensor,
        q_residual: torch.Tensor,
        step: DecodeStep,
        cache: DecodeLayerCache,
        rope: V4Rope,
    ) -> torch.Tensor:
        """Attention for B sequences of one token each. Each reads its window ring and, on
        CSA layers, the entries its indexer picked, on HCA layers all its entries: a pool
        [B * keys, dim] of every sequence's keys, and indices [B, k] into it of the rows each
        reads (-1: none). k is fixed by the shapes, not by how many rows each sees, so a graph
        can hold it."""
        pos, slots, size = step.positions, step.slots, self.window
        cache.swa.write(slots, pos, kv)
        keys = cache.swa.slots(slots)  # [B, size, dim]: positions pos - size + 1 .. pos
        col = torch.arange(size, device=x.device)
        ring_pos = pos[:, None] - (pos[:, None] - col) % size
        indices = torch.where(ring_pos >= 0, col, -1)  # rows of positions before 0: never written
        if self.compressor is not None:
            assert cache.compressor is not None
            if isinstance(self.compressor, CSACompressor):  # the entries the indexer picks
                assert cache.indexer is not None
                self.compressor.decode_append(x, step, cache.compressor, rope)
                indexer = self.compressor.indexer
                picks = indexer.decode_pick(x, q_residual, step, cache.indexer, rope)
                entries = cache.compressor[0].read(step.block_tables, picks.clamp(min=0))
                real = picks >= 0
            else:  # every entry
                entries, real = self.compressor.decode_entries(x, step, cache.compressor, rope)
            after_window = torch.arange(size, size + real.shape[1], device=x.device)
            keys = torch.cat((keys, entries), dim=1)
            indices = torch.cat((indices, torch.where(real, after_window, -1)), dim=1)
        offsets = torch.arange(pos.shape[0], device=x.device)[:, None] * keys.shape[1]
        indices = torch.where(indices >= 0, indices + offsets, -1)
        pool = keys.reshape(-1, keys.shape[-1])
        return ops.sparse_mqa(q, pool, indices, self.sinks, self.softmax_scale)


def _indices(seen: torch.Tensor) -> torch.Tensor:
    """[n, keys] bool -> [n, k] the columns each row reads, in order, -1 after (k: the most
    any row reads)."""
    cols = seen.shape[1]
    k = int(seen.sum(dim=1).max()) if seen.numel() else 0
    index = torch.arange(cols, device=seen.device).expand_as(seen)
    index = torch.where(seen, index, cols).sort(dim=1).values[:, :k]
    return index.masked_fill(index == cols, -1)


# ---- MoE ------------------------------------------------------------------------------------


class V4MoE(MoE):
    """Routed experts scored by ``scoring_func`` (sqrt(softplus)); learned layers pick the top-k
    by score + bias, hash layers by token id. Weights are the picked scores renormalised (always,
    as transformers does) times ``routed_scaling_factor``. One shared expert; SwiGLU clamped."""

    def __init__(self, config: V4ModelConfig, layer_id: int, placement: ExpertPlacement) -> None:
        super().__init__(config, layer_id, placement)  # type: ignore[arg-type]
        self.v4 = config
        self.hashed = config.mlp_layer_types[layer_id] == "hash_moe"
        e, h = config.n_routed_experts, config.hidden_size
        self.gate = (
            HashRouter(e, h, config.vocab_size, config.num_experts_per_tok)
            if self.hashed
            else Router(e, h)
        )
        self.swiglu_limit = config.swiglu_limit
        h, inter = config.hidden_size, config.moe_intermediate_size
        self.shared_experts = MLP(h, inter, config.swiglu_limit)

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.v4
        logits = F.linear(x.float(), self.gate.weight)
        if not self.hashed:
            return ops.moe_route(
                logits,
                self.correction_bias,
                c.num_experts_per_tok,
                1,
                1,
                True,
                c.routed_scaling_factor,
                c.scoring_func,
            )
        if input_ids is None:
            raise ValueError(f"MoE layer {self.moe_layer} routes by token id: pass input_ids")
        assert isinstance(self.gate, HashRouter)
        ids = self.gate.tid2eid[input_ids]
        weights = expert_scores(logits, c.scoring_func).gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids
