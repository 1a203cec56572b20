"""Building blocks of the DeepSeek-V4 decoder, as transformers' ``DeepseekV4ForCausalLM`` computes
them (the parity oracle): mHC hyper-connections with Sinkhorn, shared-KV MQA with attention sinks
over a sliding window plus compressed entries (CSA: overlapping windows chosen by the lightning
indexer; HCA: long windows, all attended), the grouped output projection, and hash-routed or
sqrt(softplus)-routed MoE with the SwiGLU clamp.

Parameter names follow the HF checkpoints (``self_attn.compressor.indexer.q_b_proj`` ...); the
routed experts are stacked per physical slot, as for V3.

Every sequence continues from its cache (``kv_cache_v4``): the window's rows and the compressors'
open rows in its state slot, the compressed entries in its blocks. One path serves prefill chunks
ending anywhere and decode steps alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferry import kernels as ops
from ferry.kernels.moe_routing.reference import expert_scores
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.config_v4 import CSA, HCA, V4ModelConfig
from ferry.services.engine.model.kv_cache_v4 import CompressorCache, LayerCache
from ferry.services.engine.model.layers import MLP, HashRouter, MoE, Router
from ferry.services.engine.model.rope import V4Rope

NEG_INF = float("-inf")


class V4RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies in float32 before the cast back (V4's; V3's casts
    first). ``weight=False``: no weight (the per-head query norm, the mHC input norm)."""

    def __init__(self, dim: int, eps: float, weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return x * inv.to(x.dtype)
        return (self.weight * (x.float() * inv)).to(x.dtype)


@dataclass(frozen=True)
class Sequence:
    """One sequence's new tokens in the flat batch, after ``done`` cached ones."""

    rows: slice
    positions: torch.Tensor  # [n] int64: done .. done + n - 1
    done: int
    block_ids: torch.Tensor  # int64, covering done + n tokens
    slot: int  # its state slot
    # (position P, snapshot id): copy the slot's rings into the snapshot once P tokens are in
    snapshots: tuple[tuple[int, int], ...] = ()

    def pieces(self) -> list[tuple[Sequence, int | None]]:
        """The sequence cut at its snapshot positions, each piece with the snapshot to take
        after it (a layer runs the pieces in order, so a later piece reads what an earlier
        one wrote, as the next step would)."""
        out: list[tuple[Sequence, int | None]] = []
        start = self.done
        for pos, snap in sorted(self.snapshots):
            out.append((self._piece(start, pos), snap))
            start = pos
        end = self.done + self.positions.shape[0]
        if start < end or not out:
            out.append((self._piece(start, end), None))
        return out

    def _piece(self, start: int, end: int) -> Sequence:
        a, b = start - self.done, end - self.done
        rows = slice(self.rows.start + a, self.rows.start + b)
        return Sequence(rows, self.positions[a:b], start, self.block_ids, self.slot)


@dataclass(frozen=True)
class DecodeStep:
    """B sequences that bring one token each, run at once (the decode path)."""

    rows: torch.Tensor  # [B] their rows of the flat batch
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] state slots
    block_tables: torch.Tensor  # [B, most blocks] int64, 0-padded
    snapshots: list[tuple[int, int]]  # (state slot, snapshot id) to take after the token

    @classmethod
    def of(cls, seqs: list[Sequence]) -> DecodeStep:
        device = seqs[0].positions.device
        tables = torch.nn.utils.rnn.pad_sequence([s.block_ids for s in seqs], batch_first=True)
        return cls(
            torch.tensor([s.rows.start for s in seqs], device=device),
            torch.cat([s.positions for s in seqs]),
            torch.tensor([s.slot for s in seqs], device=device),
            tables,
            [(s.slot, snap) for s in seqs for _, snap in s.snapshots],
        )


def _ring_rows(ring: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions start .. end - 1 of a ring [rows, dim] (a copy: read before writing)."""
    return ring[torch.arange(start, end, device=ring.device) % ring.shape[0]]


def _ring_keep(ring: torch.Tensor, done: int, new: torch.Tensor) -> None:
    """Write the rows of positions done .. done + len(new) - 1 that the ring has room for."""
    n, size = new.shape[0], ring.shape[0]
    keep = min(n, size)
    idx = torch.arange(done + n - keep, done + n, device=ring.device) % size
    ring[idx] = new[n - keep :].to(ring.dtype)


# ---- mHC ----------------------------------------------------------------------------------


class HyperConnection(nn.Module):
    """Mixes the ``hc_mult`` residual streams around one sublayer: ``pre`` collapses them into
    the sublayer's input, ``post`` spreads its output back, ``comb`` (made doubly stochastic by
    Sinkhorn) mixes the streams themselves. Kept in float32."""

    def __init__(self, config: V4ModelConfig) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc, self.iters, self.eps = hc, config.hc_sinkhorn_iters, config.hc_eps
        self.norm = V4RMSNorm(hc * config.hidden_size, config.rms_norm_eps, weight=False)
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + hc) * hc))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc, hidden] -> (post [T, hc], comb [T, hc, hc], collapsed [T, hidden])."""
        hc = self.hc
        mixes = F.linear(self.norm(streams.flatten(1).float()), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc)
        comb = comb.softmax(dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new streams: post ⊗ out + combᵀ · streams."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


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


# ---- compressors and the indexer -----------------------------------------------------------


class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry: a softmax over the window's slots (per
    channel, float32, with a learned bias per slot position) weighs their projected rows, then
    ``kv_norm`` and RoPE at the window's first position. ``overlap`` (CSA): each token projects
    two series, and entry w pools window w-1's first series with window w's second (window 0's
    first half carries no weight)."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = V4RMSNorm(head_dim, eps)

    def entries(
        self, x: torch.Tensor, seq: Sequence, cache: CompressorCache, rope: V4Rope
    ) -> torch.Tensor:
        """Pool the windows that ``seq``'s new rows x [n, hidden] complete into its paged
        entries, keep the rows later windows need in its ring, and return every entry so far
        [(done + n) // rate, dim]."""
        m, n, done = self.rate, x.shape[0], seq.done
        width = self.kv_proj.out_features
        rows = torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1)  # [n, kv | gate]
        ring = cache.rows[seq.slot]
        first = max(0, done - done % m - (m if self.overlap else 0))  # what open windows need
        src = torch.cat((_ring_rows(ring, first, done), rows.to(ring.dtype)))
        _ring_keep(ring, done, rows)
        start_w, end_w = done // m, (done + n) // m
        per_block = cache.entries.shape[1]
        flat = cache.entries.view(-1, self.head_dim)
        if end_w > start_w:
            pooled = self._pool(src[:, :width], src[:, width:], first, start_w, end_w, rope)
            w = torch.arange(start_w, end_w, device=x.device)
            flat[seq.block_ids[w // per_block] * per_block + w % per_block] = pooled
        w = torch.arange(end_w, device=x.device)
        return flat[seq.block_ids[w // per_block] * per_block + w % per_block]

    def _pool(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        first: int,
        start_w: int,
        end_w: int,
        rope: V4Rope,
    ) -> torch.Tensor:
        """Entries start_w .. end_w - 1 from rows kv, gate [*, width] of positions first ..."""
        m = self.rate
        w = torch.arange(start_w, end_w, device=kv.device)
        idx = w[:, None] * m + torch.arange(m, device=kv.device) - first  # [windows, m]
        prev = (idx - m).clamp(min=0)  # the window before (read only with the overlap)
        return self._pool_windows(kv[idx], gate[idx], kv[prev], gate[prev], w, rope)

    def _pool_windows(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        prev_kv: torch.Tensor,
        prev_gate: torch.Tensor,
        w: torch.Tensor,
        rope: V4Rope,
    ) -> torch.Tensor:
        """Entries of windows ``w`` [N] from their rows kv, gate [N, rate, width] and, for the
        overlap, the rows of the window before each (ignored for window 0)."""
        m, d = self.rate, self.head_dim
        gate = gate + self.position_bias
        if self.overlap:  # window w - 1's first series, then window w's second
            none = (w == 0)[:, None, None]  # window 0 has no window before it
            prev_kv = prev_kv[..., :d].masked_fill(none, 0.0)
            prev_gate = (prev_gate + self.position_bias)[..., :d].masked_fill(none, NEG_INF)
            kv = torch.cat((prev_kv, kv[..., d:]), dim=1)  # [N, 2m, d]
            gate = torch.cat((prev_gate, gate[..., d:]), dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = rope.cos_sin(w * m, "compress", pooled.dtype)
        return V4Rope.rotate(pooled[:, None], cos, sin)[:, 0]

    def decode_entries(
        self, x: torch.Tensor, step: DecodeStep, cache: CompressorCache, rope: V4Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``entries`` for B sequences of one new token each, at once: their rows x [B, hidden]
        join their rings, the windows they complete are pooled into their blocks. Returns
        every entry so far, padded [B, most, dim], and which are real [B, most]."""
        m, width = self.rate, self.kv_proj.out_features
        ring_size = cache.rows.shape[1]
        pos, slots = step.positions, step.slots
        rows = torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1)
        cache.rows[slots, pos % ring_size] = rows.to(cache.rows.dtype)
        per_block = cache.entries.shape[1]
        flat = cache.entries.view(-1, self.head_dim)
        done = ((pos + 1) % m == 0).nonzero()[:, 0]
        if done.numel():  # these close window w: its rows (and the window before) are in the ring
            w = (pos[done] + 1) // m - 1
            at = w[:, None] * m + torch.arange(m, device=x.device)  # [N, m] positions
            ring = cache.rows[slots[done]]  # [N, ring rows, 2 * width]
            cur = ring.gather(1, (at % ring_size)[..., None].expand(-1, -1, ring.shape[-1]))
            prev = ring.gather(1, ((at - m) % ring_size)[..., None].expand(-1, -1, ring.shape[-1]))
            pooled = self._pool_windows(
                cur[..., :width], cur[..., width:], prev[..., :width], prev[..., width:], w, rope
            )
            blocks = step.block_tables[done].gather(1, (w // per_block)[:, None])[:, 0]
            flat[blocks * per_block + w % per_block] = pooled
        count = (pos + 1) // m
        e = torch.arange(int(count.max()), device=x.device)
        index = step.block_tables.gather(1, (e // per_block)[None, :].expand(len(pos), -1))
        return flat[index * per_block + e % per_block], e[None, :] < count[:, None]

    def visible(self, positions: torch.Tensor, num_entries: int) -> torch.Tensor:
        """[n, num_entries] bool: entry w holds tokens up to (w + 1) * rate - 1, so query t
        sees it once w < (t + 1) // rate."""
        w = torch.arange(num_entries, device=positions.device)
        return w[None, :] < ((positions + 1) // self.rate)[:, None]


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at
    ``index_head_dim`` gives keys; query t scores entry s as Σ_h w[t,h]·ReLU(q[t,h]·k[s]) in
    float32 and keeps its ``index_topk`` best visible entries."""

    def __init__(self, config: V4ModelConfig) -> None:
        c = config
        super().__init__(c.hidden_size, c.index_head_dim, c.csa_rate, True, c.rms_norm_eps)
        self.heads, self.topk = c.index_n_heads, c.index_topk
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
        self.scorer = IndexerScorer(c.hidden_size, c.index_n_heads)

    def pick(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        seq: Sequence,
        cache: CompressorCache,
        rope: V4Rope,
    ) -> torch.Tensor:
        """[n, min(index_topk, entries)] int64 entry ids per query, -1 where fewer are
        visible."""
        keys = self.entries(x, seq, cache, rope)
        return self.choose(x, q_residual, seq.positions, keys, rope)

    def choose(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        rope: V4Rope,
    ) -> torch.Tensor:
        """The top-k of ``keys`` [entries, dim] for queries at ``positions``."""
        n, d = x.shape[0], self.head_dim
        q = self.q_b_proj(q_residual).view(n, self.heads, d)
        q = V4Rope.rotate(q, *rope.cos_sin(positions, "compress", q.dtype))
        scores = F.relu(torch.matmul(q.float(), keys.float().T)) * d**-0.5  # [n, heads, E]
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [n, heads]
        total = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [n, E]
        visible = self.visible(positions, keys.shape[0])
        total = total.masked_fill(~visible, NEG_INF)
        picks = total.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return torch.where(visible.gather(1, picks), picks, torch.full_like(picks, -1))

    def decode_pick(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        step: DecodeStep,
        cache: CompressorCache,
        rope: V4Rope,
    ) -> torch.Tensor:
        """``pick`` for B sequences of one new token each: [B, most] bool, the chosen of each
        one's entries (all of which it sees)."""
        keys, real = self.decode_entries(x, step, cache, rope)
        if keys.shape[1] == 0:
            return real
        n, d = x.shape[0], self.head_dim
        q = self.q_b_proj(q_residual).view(n, self.heads, d)
        q = V4Rope.rotate(q, *rope.cos_sin(step.positions, "compress", q.dtype))
        scores = F.relu(torch.einsum("bhd,bed->bhe", q.float(), keys.float())) * d**-0.5
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [B, heads]
        total = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~real, NEG_INF)
        picks = total.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        chosen = torch.zeros_like(real)
        return chosen.scatter_(1, picks, real.gather(1, picks))


class CSACompressor(Compressor):
    def __init__(self, config: V4ModelConfig) -> None:
        c = config
        super().__init__(c.hidden_size, c.head_dim, c.csa_rate, True, c.rms_norm_eps)
        self.indexer = Indexer(config)


class HCACompressor(Compressor):
    def __init__(self, config: V4ModelConfig) -> None:
        c = config
        super().__init__(c.hidden_size, c.head_dim, c.hca_rate, False, c.rms_norm_eps)


# ---- attention ------------------------------------------------------------------------------


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: the input splits into ``groups`` equal parts, each projected
    by its own rows of ``weight`` ([groups * out_per_group, in_per_group])."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, groups, in_per_group] -> [T, groups * out_per_group]."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)


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
        seqs: list[Sequence],
        cache: LayerCache,
        rope: V4Rope,
    ) -> torch.Tensor:
        """x: [T, hidden] (the normed block input) -> [T, hidden]; reads and extends each
        sequence's part of this layer's ``cache``."""
        n = x.shape[0]
        cos, sin = rope.cos_sin(positions, self.table, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_norm(self.q_b_proj(q_residual).view(n, self.heads, self.head_dim))
        q = V4Rope.rotate(q, cos, sin)
        kv = V4Rope.rotate(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]
        out = torch.empty_like(q)
        singles = [s for s in seqs if s.positions.shape[0] == 1]
        if singles:  # decode tokens: one batched pass
            step = DecodeStep.of(singles)
            i = step.rows
            keys, bias = self._decode_context(x[i], kv[i], q_residual[i], step, cache, rope)
            out[i] = ops.sink_attention(q[i], keys, bias, self.sinks, self.softmax_scale)
            for slot, snap in step.snapshots:
                cache.save(slot, snap)
        for seq in seqs:  # prefill chunks, one at a time
            if seq.positions.shape[0] == 1:
                continue
            for piece, snapshot in seq.pieces():
                r = piece.rows
                keys, bias = self._context(x[r], kv[r], q_residual[r], piece, cache, rope)
                out[r] = ops.sink_attention(q[r], keys, bias, self.sinks, self.softmax_scale)
                if snapshot is not None:
                    cache.save(piece.slot, snapshot)
        out = V4Rope.rotate(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.view(n, self.o_groups, -1)))

    def _context(
        self,
        x: torch.Tensor,
        kv: torch.Tensor,
        q_residual: torch.Tensor,
        seq: Sequence,
        cache: LayerCache,
        rope: V4Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys a sequence's queries read, [window rows | compressed entries], and the
        additive bias [n, keys] that says which each query sees."""
        done, n, positions = seq.done, x.shape[0], seq.positions
        ring = cache.swa[seq.slot]
        first = max(0, done - self.window + 1)
        window = torch.cat((_ring_rows(ring, first, done), kv.to(ring.dtype)))
        _ring_keep(ring, done, kv)
        dist = positions[:, None] - torch.arange(first, done + n, device=x.device)[None, :]
        seen = (dist >= 0) & (dist < self.window)  # the last `window` tokens, itself included
        if self.compressor is None:
            return window, _bias(seen)
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
        return torch.cat((window, entries)), _bias(torch.cat((seen, visible), dim=1))

    def _decode_context(
        self,
        x: torch.Tensor,
        kv: torch.Tensor,
        q_residual: torch.Tensor,
        step: DecodeStep,
        cache: LayerCache,
        rope: V4Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_context`` for B sequences of one token each: keys [B, keys, dim] per sequence (its
        window ring, then its entries, padded) and the bias [B, keys]."""
        pos, slots, size = step.positions, step.slots, cache.swa.shape[1]
        cache.swa[slots, pos % size] = kv.to(cache.swa.dtype)
        window = cache.swa[slots]  # [B, size, dim]: positions pos - size + 1 .. pos
        ring_pos = pos[:, None] - (pos[:, None] - torch.arange(size, device=x.device)) % size
        seen = ring_pos >= 0  # the rows of positions before 0 were never written
        if self.compressor is None:
            return window, _bias(seen)
        assert cache.compressor is not None
        entries, visible = self.compressor.decode_entries(x, step, cache.compressor, rope)
        if isinstance(self.compressor, CSACompressor):  # before any entry too: its rows
            assert cache.indexer is not None
            indexer = self.compressor.indexer
            visible = indexer.decode_pick(x, q_residual, step, cache.indexer, rope)
        return torch.cat((window, entries), dim=1), _bias(torch.cat((seen, visible), dim=1))


def _bias(seen: torch.Tensor) -> torch.Tensor:
    return torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill(
        ~seen, NEG_INF
    )


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
