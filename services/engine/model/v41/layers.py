"""Building blocks of the DeepSeek-V4.1 decoder, as DeepSeek's reference computes them in its
float32 ("math") form:

- attention: shared-KV MQA with per-head sinks over the layer's sliding window plus, on ratio-1
  and ratio-2 layers, the compressed entries its index source chose; only the kv sources compress
  (``Compressor``) and only the index sources score (``Indexer``), the other layers read what the
  nearest source below them published in the same forward (``Published``);
- the two-level top-k: the candidate source keeps the best blocks of entries, the index sources
  above it choose inside them;
- mHC whose pre-mix comes from the previous sublayer (``V41Block``), and sqrt(softplus) MoE with
  a router temperature and no hash layers.

Every layer runs a ``Step``: chunks of one or more sequences, each after the rows its ``History``
holds (a prefill from position 0 is a chunk with an empty state, a decode step a chunk of one
token). Projections, mHC and MoE run over the step's tokens at once; attention, the compressors
and the indexers sequence by sequence (``Span``).

Parameter names follow V4's Ferry names where the part is V4's (``self_attn.q_a_proj``,
``mlp.experts.w13`` ...) and DeepSeek's leaf names for V4.1's own parts
(``self_attn.compressor.indexer_k_proj`` ...: see ``checkpoint_names``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ferry import kernels as ops
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.mhc import GroupedLinear, HyperConnection, V4RMSNorm
from ferry.services.engine.model.moe import MLP, MoE, Router
from ferry.services.engine.model.rope import V4Rope
from ferry.services.engine.model.v41.config import V41ModelConfig
from ferry.services.engine.model.v41.quant import AUTO, CacheFormat, rounded

NEG = -torch.inf

# ---- one sequence's history -------------------------------------------------------------------


class History:
    """What a sequence's next chunk reads of its earlier tokens, and what it leaves for later:
    per layer the window's rows (rotated, K = V), per kv source its compressed entries (rotated)
    and index keys, a ratio-2 source's open rows (kv and score of a pair not yet pooled), and
    Engram's look-back. ``SequenceState`` keeps them in tensors of its own; the engine's cache
    in its blocks and the request's state slot (``kv_cache.PagedHistory``)."""

    length: int  # tokens before the chunk
    # (position, snapshot): the prefix cache keeps what a block boundary inside the chunk holds,
    # the history after ``position`` tokens, as ``snapshot`` (the engine's cache only)
    snapshots: Sequence[tuple[int, int]] = ()
    _chunk_tokens: int = 0

    def begin(self, tokens: int) -> None:
        """A chunk of ``tokens`` starts."""
        self._chunk_tokens = tokens

    def end(self) -> None:
        """The chunk is in: its tokens are history now."""
        self.length += self._chunk_tokens

    def window(self, layer: int) -> torch.Tensor | None:
        """The window's rows before the chunk, oldest first: [min(length, W), head_dim]
        (None: the sequence starts here)."""
        raise NotImplementedError

    def keep_window(self, layer: int, rows: torch.Tensor) -> None:
        """The window's rows after the chunk (its last ``sliding_window``), oldest first."""
        raise NotImplementedError

    def snapshot_window(self, layer: int, snapshot: int, position: int, rows: torch.Tensor) -> None:
        """The window's rows after ``position`` tokens, for ``snapshot``."""
        raise NotImplementedError

    def entries(self, source: int) -> torch.Tensor | None:
        """Every compressed entry so far: [n, head_dim] (None: none yet)."""
        raise NotImplementedError

    def index_keys(self, source: int) -> torch.Tensor:
        raise NotImplementedError

    def add_entries(self, source: int, entries: torch.Tensor, keys: torch.Tensor) -> None:
        raise NotImplementedError

    def open_rows(self, source: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """kv and score rows of the positions after the last whole pair (None: none)."""
        raise NotImplementedError

    def keep_open_rows(self, source: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        raise NotImplementedError

    def engram_lookback(self) -> torch.Tensor | None:
        """The compressed ids of the last tokens (None: the sequence starts here)."""
        raise NotImplementedError

    def keep_engram_lookback(self, ids: torch.Tensor) -> None:
        raise NotImplementedError

    def snapshot_engram_lookback(self, snapshot: int, ids: torch.Tensor) -> None:
        raise NotImplementedError


class SequenceState(History):
    """One sequence's history in tensors of its own (parity tests, offline use)."""

    def __init__(self) -> None:
        self.length = 0
        self._window: dict[int, torch.Tensor] = {}
        self._entries: dict[int, torch.Tensor] = {}
        self._keys: dict[int, torch.Tensor] = {}
        self._open: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lookback: torch.Tensor | None = None

    def window(self, layer: int) -> torch.Tensor | None:
        return self._window.get(layer)

    def keep_window(self, layer: int, rows: torch.Tensor) -> None:
        self._window[layer] = rows

    def entries(self, source: int) -> torch.Tensor | None:
        return self._entries.get(source)

    def index_keys(self, source: int) -> torch.Tensor:
        return self._keys[source]

    def add_entries(self, source: int, entries: torch.Tensor, keys: torch.Tensor) -> None:
        for store, new in ((self._entries, entries), (self._keys, keys)):
            store[source] = torch.cat([store[source], new]) if source in store else new

    def open_rows(self, source: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._open.get(source)

    def keep_open_rows(self, source: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        self._open[source] = (kv, score)

    def engram_lookback(self) -> torch.Tensor | None:
        return self._lookback

    def keep_engram_lookback(self, ids: torch.Tensor) -> None:
        self._lookback = ids


@dataclass
class Published:
    """What the layers of one forward hand up the stack: the latest index source's chosen
    entries ([T, index_topk], -1 = none) and the candidate source's mask ([T, entries])."""

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


@dataclass
class Trace:
    """The discrete choices of a forward, by layer, for parity checks (None: not recorded)."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    block_out: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk:
    """A chunk's positions, the RoPE tables and how the cache rounds what it keeps."""

    positions: torch.Tensor  # [T] int64, start .. start + T - 1
    rope: V4Rope
    cache: CacheFormat = AUTO

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def end(self) -> int:
        return int(self.positions[-1]) + 1

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, table: str, inverse: bool = False
    ) -> torch.Tensor:
        """x [n, ..., dim]: its trailing rope dims rotated at ``positions`` [n] (interleaved)."""
        cos, sin = self.rope.cos_sin(positions, table, torch.float32)
        if x.dim() == 2:
            cos, sin = cos[:, 0], sin[:, 0]
        return V4Rope.rotate(x, cos, -sin if inverse else sin)


@dataclass
class Span:
    """One sequence's rows of a step: its chunk, its history, what its layers hand up."""

    rows: slice
    chunk: Chunk
    state: History
    published: Published = field(default_factory=Published)
    trace: Trace | None = None


@dataclass(frozen=True)
class Step:
    """A forward's sequences, their rows one after another; ``whole`` has every row's position
    (the step's rotations at once)."""

    spans: list[Span]
    whole: Chunk


# ---- compressor and indexer -------------------------------------------------------------------


class Compressor(nn.Module):
    """A kv source's compressed entries: ratio 2 pools each pair of tokens by a per-channel
    softmax of ``gate_proj`` (no overlap, no position bias), ratio 1 projects each token. Also
    the index keys, derived from the entry before RoPE (``indexer_k_proj``, ``indexer_k_norm``).
    Entry j stands for tokens [j r, (j + 1) r) and is rotated at position j r."""

    def __init__(self, config: V41ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.ratio = config.ratio(layer_id)
        d = config.head_dim
        self.kv_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, d, bias=False) if self.ratio > 1 else None
        self.kv_norm = V4RMSNorm(d, config.rms_norm_eps)
        self.indexer_k_proj = nn.Linear(d, config.index_head_dim, bias=False)
        self.indexer_k_norm = V4RMSNorm(config.index_head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] (the attention's normed input, every sequence's rows) -> ratio 1: the
        entries before RoPE and None; ratio 2: each row's kv and score, float32."""
        if self.gate_proj is None:
            return self.kv_norm(self.kv_proj(x)), None
        x = x.float()
        return self.kv_proj(x).float(), self.gate_proj(x).float()

    def pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor | None,
        layer_id: int,
        state: History,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """One sequence's projected rows -> its new entries before RoPE [T // r, head_dim],
        ratio 2's unfinished pair kept as the state's open rows."""
        if score is None:
            return kv
        if (open_rows := state.open_rows(layer_id)) is not None:
            kv, score = torch.cat([open_rows[0], kv]), torch.cat([open_rows[1], score])
        whole = kv.shape[0] - kv.shape[0] % self.ratio
        state.keep_open_rows(layer_id, kv[whole:], score[whole:])
        kv = kv[:whole].unflatten(0, (-1, self.ratio))
        weights = score[:whole].unflatten(0, (-1, self.ratio)).softmax(dim=1)
        return self.kv_norm((kv * weights).sum(dim=1).to(dtype))

    def index_keys(self, latent: torch.Tensor) -> torch.Tensor:
        return self.indexer_k_norm(self.indexer_k_proj(latent))


class Indexer(nn.Module):
    """An index source's scorer: ``index_n_heads`` query heads from the attention's q latent,
    ReLU'd dot products with one key per entry, summed with per-head weights."""

    def __init__(self, config: V41ModelConfig) -> None:
        super().__init__()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)
        self.scale = self.dim**-0.5 * self.heads**-0.5

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, chunk: Chunk
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's query heads [T, heads, dim] (rotated, rounded as the cache rounds keys)
        and their weights [T, heads]."""
        q = self.q_b_proj(q_latent).unflatten(-1, (self.heads, self.dim))
        q = rounded(chunk.cache.index, chunk.rotate(q, chunk.positions, "compress"))
        return q, self.weights_proj(x) * self.scale

    @staticmethod
    def scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """One sequence's queries against its keys [entries, dim] -> [T, entries] float32 (not
        masked), computed in the activations' dtype as the reference scores (bf16 released)."""
        dots = torch.einsum("thd,jd->thj", q, keys.to(q.dtype)).relu()
        return (dots * weights[..., None]).sum(dim=1).float()


def candidate_blocks(
    scores: torch.Tensor, reachable: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Level one of the two-level top-k: per query, the ``topk_blocks`` blocks of
    ``block_size`` entries with the best max score, always including the block of its newest
    reachable entry; unreachable blocks never count. scores [T, n] (unreachable: -inf),
    reachable [T] entries per query -> bool [T, n]."""
    n = scores.shape[-1]
    padded = F.pad(scores, (0, -n % block_size), value=-torch.inf)
    best = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    blocks = best.shape[-1]
    newest = ((reachable - 1) // block_size)[:, None]
    best = best.masked_fill(torch.arange(blocks, device=scores.device) == newest, torch.inf)
    top = best.topk(min(topk_blocks, blocks), dim=-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
        -1, top.indices, top.values > -torch.inf
    )
    return keep.repeat_interleave(block_size, dim=-1)[:, :n]


def top_entries(scores: torch.Tensor, reachable: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64: each query's best ``k`` entries with a finite score, ascending, -1 after."""
    n = scores.shape[-1]
    out = torch.full((scores.shape[0], k), -1, dtype=torch.long, device=scores.device)
    if n == 0:
        return out
    top = scores.topk(min(k, n), dim=-1)
    idx = torch.where(top.values > -torch.inf, top.indices, n)
    idx = torch.where(idx < reachable[:, None], idx, n).sort(dim=-1).values
    out[:, : idx.shape[1]] = torch.where(idx < n, idx, -1)
    return out


# ---- attention --------------------------------------------------------------------------------


class V41Attention(nn.Module):
    """One softmax over the layer's window rows and the chosen compressed entries, with the
    per-head sink in the denominator; the output's rope dims rotated back at the query."""

    def __init__(self, config: V41ModelConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.config, self.layer_id = c, layer_id
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.ratio = c.ratio(layer_id)
        self.table = "compress" if self.ratio else "main"
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = V4RMSNorm(c.head_dim, c.rms_norm_eps)
        group_in = c.num_attention_heads * c.head_dim // c.o_groups
        self.o_a_proj = GroupedLinear(group_in, c.o_groups * c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(c.num_attention_heads))
        self.compressor = Compressor(c, layer_id) if layer_id in c.kv_source_layer_ids else None
        self.indexer = Indexer(c) if layer_id in c.index_source_layer_ids else None
        self.scale = c.head_dim**-0.5

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] (normed, every sequence's rows) -> [T, hidden]."""
        whole = step.whole
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).unflatten(-1, (self.heads, self.head_dim))
        q = whole.rotate(q, whole.positions, self.table)
        kv = whole.rotate(self.kv_norm(self.kv_proj(x)), whole.positions, self.table)
        kv = rounded(whole.cache.window, kv)
        # the compressor's and indexer's projections, every row at once; the rest by sequence
        pooled = self.compressor.project(x) if self.compressor is not None else None
        index = self.indexer.queries(x, q_latent, whole) if self.indexer is not None else None
        out = torch.cat(
            [
                self._attend(q[s.rows], kv[s.rows], s, _rows(pooled, s), _rows(index, s), x.dtype)
                for s in step.spans
            ]
        )
        out = whole.rotate(out, whole.positions, self.table, inverse=True)
        out = out.reshape(len(x), self.config.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(out))

    def _attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        span: Span,
        pooled: tuple[torch.Tensor, torch.Tensor | None] | None,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """One sequence's rows: its queries [T, heads, head_dim] over its window and chosen
        entries -> [T, heads, head_dim], still rotated. ``pooled`` and ``index``: its rows of
        the compressor's and indexer's projections (None: the layer has none)."""
        chunk, state = span.chunk, span.state
        keys, mask = self._window(kv, chunk, state)
        qf = q.float()
        # window rows, shared by every query [rows, head_dim]; chosen entries, a set per query
        # [T, k, head_dim]: scored apart, one softmax over both and the sink
        scores = [torch.einsum("thd,kd->thk", qf, keys.float()).masked_fill(~mask[:, None], NEG)]
        if self.ratio:
            entries, chosen = self._compressed(span, pooled, index, dtype)
            padded = torch.cat([entries, entries.new_zeros(1, entries.shape[1])]).float()
            picked = padded[chosen.where(chosen >= 0, len(entries))]
            picked_scores = torch.einsum("thd,tkd->thk", qf, picked)
            scores.append(picked_scores.masked_fill((chosen < 0)[:, None], NEG))
        probs = self._probabilities(torch.cat(scores, dim=-1) * self.scale, dtype)
        out = torch.einsum("thk,kd->thd", probs[..., : len(keys)], keys.float())
        if self.ratio:
            picked_probs = probs[..., len(keys) : len(keys) + chosen.shape[1]]
            out = out + torch.einsum("thk,tkd->thd", picked_probs, picked)
        return out.to(dtype)

    def _probabilities(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Softmax over [T, heads, rows] with each head's sink in the denominator only. The
        numerators are rounded to the activations' dtype before they weigh the rows, as the
        reference's kernel feeds them to its P.V product (bf16 in the released model)."""
        top = logits.amax(-1, keepdim=True).clamp_min(-1e30)  # a row of -inf: none seen
        p = (logits - top).exp()
        total = p.sum(-1, keepdim=True) + (self.sinks.float()[:, None] - top).exp()
        return p.to(dtype).float() / total

    def _window(
        self, kv: torch.Tensor, chunk: Chunk, state: History
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's rows (the state's, then the chunk's) and which each query sees:
        [rows, head_dim], bool [T, rows]."""
        w = self.config.sliding_window
        before = state.window(self.layer_id)
        if before is None:
            before = kv[:0]
        rows = torch.cat([before.to(kv), kv])
        state.keep_window(self.layer_id, rows[-w:])
        key_pos = torch.arange(chunk.start - len(before), chunk.end, device=kv.device)
        for position, snapshot in state.snapshots:
            before_it = rows[key_pos < position][-w:]
            state.snapshot_window(self.layer_id, snapshot, position, before_it)
        q_pos = chunk.positions[:, None]
        return rows, (key_pos[None, :] <= q_pos) & (key_pos[None, :] > q_pos - w)

    def _compressed(
        self,
        span: Span,
        pooled: tuple[torch.Tensor, torch.Tensor | None] | None,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The source's entries [n, head_dim] and each query's chosen ones [T, index_topk]."""
        c, r = self.config, self.ratio
        chunk, state, published = span.chunk, span.state, span.published
        device = chunk.positions.device
        source = c.kv_source_of(self.layer_id)
        assert source is not None
        if self.compressor is not None:
            assert pooled is not None
            done = state.length // r
            latent = self.compressor.pool(*pooled, self.layer_id, state, dtype)
            where = torch.arange(done, done + len(latent), device=device) * r
            rotated = rounded(chunk.cache.entries, chunk.rotate(latent, where, "compress"))
            keys = chunk.rotate(self.compressor.index_keys(latent), where, "compress")
            keys = rounded(chunk.cache.index, keys)
            state.add_entries(source, rotated, keys)
        entries = state.entries(source)
        if entries is None:
            entries = torch.zeros(0, c.head_dim, dtype=dtype, device=device)
        if index is not None:
            published.topk = self._choose(span, *index)
        assert published.topk is not None
        return entries, published.topk

    def _choose(self, span: Span, q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c, r, layer = self.config, self.ratio, self.layer_id
        chunk, state, published, trace = span.chunk, span.state, span.published, span.trace
        source = c.kv_source_of(layer)  # the latest key owner at or below: same ratio
        assert source is not None
        keys = state.index_keys(source)
        reachable = (chunk.positions + 1) // r  # entries j < (t + 1) // r
        scores = Indexer.scores(q, weights, keys)
        future = torch.arange(len(keys), device=q.device)[None, :] >= reachable[:, None]
        scores = scores.masked_fill(future, -torch.inf)
        if layer == c.candidate_source_layer_id:
            published.candidates = candidate_blocks(
                scores, reachable, c.candidate_topk_blocks, c.candidate_block_size
            )
            if trace is not None:
                trace.candidates[layer] = published.candidates
        elif c.uses_candidates(layer):
            assert published.candidates is not None
            scores = scores.masked_fill(~published.candidates, -torch.inf)
        chosen = top_entries(scores, reachable, c.index_topk)
        if trace is not None:
            trace.topk[layer] = chosen
        return chosen


def _rows(projected: tuple[torch.Tensor | None, ...] | None, span: Span) -> tuple | None:
    """A span's rows of each of a step's projections (None: none)."""
    if projected is None:
        return None
    return tuple(t if t is None else t[span.rows] for t in projected)


# ---- MoE ----------------------------------------------------------------------------------------


class V41MoE(MoE):
    """Every layer learned-routed: experts by top-k of sqrt(softplus(logits / gate_temp)) +
    bias, weighted by the unbiased scores renormalised and scaled. One clamped shared expert."""

    def __init__(self, config: V41ModelConfig, layer_id: int, placement: ExpertPlacement) -> None:
        super().__init__(config, layer_id, placement)  # type: ignore[arg-type]
        self.v41 = config
        self.gate = Router(config.n_routed_experts, config.hidden_size)
        self.swiglu_limit = config.swiglu_limit
        h, inter = config.hidden_size, config.moe_intermediate_size
        self.shared_experts = MLP(h, inter * config.n_shared_experts, config.swiglu_limit)

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.v41
        logits = F.linear(x.float(), self.gate.weight.float()) / c.gate_temp
        return ops.moe_route(
            logits,
            self.correction_bias,
            c.num_experts_per_tok,
            1,
            1,
            c.norm_topk_prob and c.num_experts_per_tok > 1,
            c.routed_scaling_factor,
            c.scoring_func,
        )


# ---- the block --------------------------------------------------------------------------------


class V41HyperConnection(HyperConnection):
    """V4's mHC coefficients; V4.1 collapses a sublayer's input with the *previous* sublayer's
    pre-mix, so ``coefficients`` returns pre as well and ``collapse`` takes it."""

    mixes_in_forward = False

    def coefficients(
        self, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, hidden] -> (pre [T, hc], post [T, hc], comb [T, hc, hc])."""
        return self.split(streams, self.fn, self.base, self.scale)

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
