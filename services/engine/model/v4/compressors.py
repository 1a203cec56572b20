r"""DeepSeek-V4's compressors and what they work on: a sequence's new tokens (``Sequence``, or a
batch of one-token ``DecodeStep``\ s), the rings of its state slot, and the norm V4 uses.

A compressor pools every ``rate`` tokens into one entry kept in the paged cache (CSA, with the
windows overlapping, and HCA); the lightning indexer is a CSA layer's own smaller compressor whose
entries are keys that each query scores to choose its top-k entries. The rows a window still needs
wait in the sequence's ring, so a prefill chunk may end anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ferry import kernels as ops
from ferry.services.engine.model.mhc import V4RMSNorm
from ferry.services.engine.model.rope import V4Rope
from ferry.services.engine.model.v4.config import V4ModelConfig
from ferry.services.engine.model.v4.kv_cache import CompressorCache, Paged, Ring

NEG_INF = float("-inf")


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


@dataclass(frozen=True)
class V4Batch:
    """A forward's sequences as every layer runs them, split once: the one-token ones as one
    ``DecodeStep``, the prefill chunks one by one."""

    decode: DecodeStep | None
    chunks: list[Sequence]

    @classmethod
    def of(cls, seqs: list[Sequence]) -> V4Batch:
        singles = [s for s in seqs if s.positions.shape[0] == 1]
        chunks = [s for s in seqs if s.positions.shape[0] > 1]
        return cls(DecodeStep.of(singles) if singles else None, chunks)


def ring_rows(ring: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions start .. end - 1 of a ring [rows, dim] (a copy: read before writing)."""
    return ring[torch.arange(start, end, device=ring.device) % ring.shape[0]]


def ring_keep(ring: torch.Tensor, done: int, new: torch.Tensor) -> None:
    """Write the rows of positions done .. done + len(new) - 1 that the ring has room for."""
    n, size = new.shape[0], ring.shape[0]
    keep = min(n, size)
    idx = torch.arange(done + n - keep, done + n, device=ring.device) % size
    ring[idx] = new[n - keep :].to(ring.dtype)


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
        src = torch.cat((ring_rows(ring, first, done), rows.to(ring.dtype)))
        ring_keep(ring, done, rows)
        start_w, end_w = done // m, (done + n) // m
        entries, per_block = cache.entries, cache.entries.shape[1]
        if end_w > start_w:
            pooled = self._pool(src[:, :width], src[:, width:], first, start_w, end_w, rope)
            w = torch.arange(start_w, end_w, device=x.device)
            entries[seq.block_ids[w // per_block], w % per_block] = pooled
        w = torch.arange(end_w, device=x.device)
        return entries[seq.block_ids[w // per_block], w % per_block]

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
        pooled = self.kv_norm(ops.compress_pool(kv, gate))
        cos, sin = rope.cos_sin(w * m, "compress", pooled.dtype)
        return V4Rope.rotate(pooled[:, None], cos, sin)[:, 0]

    def decode_append(
        self, x: torch.Tensor, step: DecodeStep, cache: tuple[Paged, Ring], rope: V4Rope
    ) -> None:
        """``entries``' writes for B sequences of one new token each, at once: their rows x
        [B, hidden] join their rings, the windows they close are pooled into their blocks.

        No shape or branch depends on the data, so a graph can hold it: every sequence pools
        its newest window, and only those this token closed keep the entry."""
        m, width = self.rate, self.kv_proj.out_features
        entries, ring = cache
        pos, slots = step.positions, step.slots
        ring.write(slots, pos, torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1))
        w = ((pos + 1) // m - 1).clamp(min=0)
        at = w[:, None] * m + torch.arange(m, device=x.device)  # [B, m] positions
        cur, prev = ring.read(slots[:, None], at), ring.read(slots[:, None], at - m)
        pooled = self._pool_windows(
            cur[..., :width], cur[..., width:], prev[..., :width], prev[..., width:], w, rope
        )
        per_block = entries.per_block
        blocks = step.block_tables.gather(1, (w // per_block)[:, None])[:, 0]
        entries.write(blocks, w % per_block, pooled, keep=(pos + 1) % m == 0)

    def decode_entries(
        self, x: torch.Tensor, step: DecodeStep, cache: tuple[Paged, Ring], rope: V4Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_append``, then every entry the block tables [B, W] can hold,
        [B, W * entries per block, dim], and which are real [B, W * entries per block]."""
        self.decode_append(x, step, cache, rope)
        tables = step.block_tables
        e = torch.arange(tables.shape[1] * cache[0].per_block, device=x.device)
        real = e[None, :] < ((step.positions + 1) // self.rate)[:, None]
        return cache[0].read(tables, e[None, :].expand(tables.shape[0], -1)), real

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
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [n, heads]
        num_visible = (positions + 1) // self.rate  # see `visible`
        return ops.indexer_topk(q, weights, keys, num_visible, min(self.topk, keys.shape[0]))

    def decode_pick(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        step: DecodeStep,
        cache: tuple[Paged, Ring],
        rope: V4Rope,
    ) -> torch.Tensor:
        """``pick`` for B sequences of one new token each, over ``decode_entries``' columns:
        [B, min(index_topk, columns)] int64, -1 where fewer are visible."""
        keys, real = self.decode_entries(x, step, cache, rope)
        n, d = x.shape[0], self.head_dim
        q = self.q_b_proj(q_residual).view(n, self.heads, d)
        q = V4Rope.rotate(q, *rope.cos_sin(step.positions, "compress", q.dtype))
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [B, heads]
        k = torch.sym_min(self.topk, keys.shape[1])  # (no guard on a graph's symbolic width)
        return ops.indexer_topk(q, weights, keys, real.sum(dim=1), k)


class CSACompressor(Compressor):
    def __init__(self, config: V4ModelConfig) -> None:
        c = config
        super().__init__(c.hidden_size, c.head_dim, c.csa_rate, True, c.rms_norm_eps)
        self.indexer = Indexer(config)


class HCACompressor(Compressor):
    def __init__(self, config: V4ModelConfig) -> None:
        c = config
        super().__init__(c.hidden_size, c.head_dim, c.hca_rate, False, c.rms_norm_eps)
