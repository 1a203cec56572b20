"""Engram of DeepSeek-V4.1: an n-gram hash lookup added into the residual streams before a few
layers (``engram_layer_ids``), as DeepSeek's reference (``inference/engram.py`` and ``Engram`` in
``inference/model.py``) computes it.

Three steps, each its own piece here:
- ``compressed_token_map``: every vocabulary id -> a compressed id, so that tokens that normalise
  alike (" The", "the", "THE", full-width or accented forms) hash alike.
- ``EngramHash``: for each position, the compressed ids of it and of the ``max_ngram - 1`` tokens
  before it, hashed as 2-grams .. max_ngram-grams over ``engram_n_heads`` heads into per-layer
  table row ids. A request carries its last ``max_ngram - 1`` compressed ids (its look-back), so a
  prefill chunk or a decode step continues the hash of the whole sequence.
- ``EngramLayer``: fetches those rows, turns them into a key per stream and one value, and adds the
  value to each stream behind a gate (fp32, the math mode of ``v41-golden``).

Text only: the reference's image spans (its DEAD token and gate mask) are not handled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from ferry.services.engine.model.config import ConfigError

SCALE_BLOCK = 32  # the table stores one E8M0 scale per 32 values of a row
GATE_FLOOR = 1e-6  # |dot| is clamped to this before the signed square root
SEED_FACTOR = 10007  # layer L's multipliers come from np.random.default_rng(SEED_FACTOR * L)
_SPACE_KEEPER = "\ue000"  # a private-use char that carries a lone " " token through Strip()


# ---- parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngramParams:
    """The Engram fields of a V4.1 ``text_config``, under their config names."""

    engram_layer_ids: tuple[int, ...]  # the layers Engram runs before, in hash-id order
    engram_num_embeddings: tuple[int, ...]  # table rows per engram layer: the sum of its primes
    engram_max_ngram_size: int  # n-grams of 2 .. this many tokens
    engram_vocab_size: int  # the bucket primes are the primes from this one upward
    engram_n_heads: int  # hash heads per n-gram size
    engram_head_dim: int  # width of a table row
    engram_pad_token_id: int  # the vocabulary id whose compressed id fills missing history
    engram_compressed_vocab_size: int  # the token map's size; the multipliers depend on it
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float

    def __post_init__(self) -> None:
        for message in self._problems():
            raise ConfigError(f"text_config: {message}")
        for layer, (rows, primes) in enumerate(
            zip(self.engram_num_embeddings, self.primes, strict=True)
        ):
            if rows != sum(primes):
                raise ConfigError(
                    f"text_config: engram_num_embeddings[{layer}] is {rows}, but layer "
                    f"{self.engram_layer_ids[layer]}'s bucket primes from engram_vocab_size "
                    f"{self.engram_vocab_size} sum to {sum(primes)}"
                )

    @classmethod
    def from_text_config(cls, d: dict[str, Any]) -> EngramParams:
        """From the HF ``text_config`` dict (a config without Engram has no ``engram_layer_ids``
        or an empty one: check that before calling)."""
        missing = [f for f in cls.__dataclass_fields__ if f not in d]
        if missing:
            raise ConfigError(f"text_config has no {missing[0]!r}")
        return cls(
            engram_layer_ids=tuple(d["engram_layer_ids"]),
            engram_num_embeddings=tuple(d["engram_num_embeddings"]),
            **{f: d[f] for f in cls.__dataclass_fields__ if f not in _LIST_FIELDS},
        )

    @property
    def n_layers(self) -> int:
        return len(self.engram_layer_ids)

    @property
    def lookback(self) -> int:
        """How many earlier tokens a position's n-grams reach back."""
        return self.engram_max_ngram_size - 1

    @property
    def n_cols(self) -> int:
        """Row ids per position and layer: one per (n-gram size, head), n-gram size major."""
        return self.lookback * self.engram_n_heads

    @cached_property
    def primes(self) -> tuple[tuple[int, ...], ...]:
        """[engram layer][n_cols] bucket sizes, in row-id column order.

        NOTE: the reference searches, for each n-gram size, upward from engram_vocab_size - 1 for
        primes not handed out before; that yields the consecutive primes >= engram_vocab_size in
        (layer, n-gram size, head) order, which is how they are produced here.
        """
        flat = _primes_from(self.engram_vocab_size, self.n_layers * self.n_cols)
        n = self.n_cols
        return tuple(tuple(flat[i * n : (i + 1) * n]) for i in range(self.n_layers))

    def _problems(self) -> list[str]:
        out = []
        ids = self.engram_layer_ids
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            out.append(f"engram_layer_ids {list(ids)}: distinct layer ids, at least one")
        if len(self.engram_num_embeddings) != len(ids):
            out.append("engram_num_embeddings needs one entry per engram_layer_ids entry")
        for name, low in _LOWER_BOUNDS.items():
            if getattr(self, name) < low:
                out.append(f"{name} is {getattr(self, name)}; it must be at least {low}")
        if self.engram_head_dim % SCALE_BLOCK:
            out.append(f"engram_head_dim {self.engram_head_dim}: a multiple of {SCALE_BLOCK}")
        return out


_LIST_FIELDS = ("engram_layer_ids", "engram_num_embeddings")
_LOWER_BOUNDS = {
    "engram_max_ngram_size": 2,
    "engram_vocab_size": 2,
    "engram_n_heads": 1,
    "engram_head_dim": SCALE_BLOCK,
    "engram_pad_token_id": 0,
    "engram_compressed_vocab_size": 1,
    "hidden_size": 1,
    "hc_mult": 1,
    "rms_norm_eps": 0,
}


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: these bases decide every n below 3.3e24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in bases:
        return True
    if any(n % p == 0 for p in bases):
        return False
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes >= ``start``."""
    out: list[int] = []
    n = start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


def hash_multipliers(params: EngramParams) -> torch.Tensor:
    """[n engram layers, max_ngram] odd int64 multipliers, one per look-back distance (0 = the
    token itself). Bounded so that compressed id x multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // params.engram_compressed_vocab_size) // 2)
    rows = []
    for layer in params.engram_layer_ids:
        rng = np.random.default_rng(SEED_FACTOR * layer)
        draws = rng.integers(0, bound, size=(params.engram_max_ngram_size,), dtype=np.int64)
        rows.append(torch.from_numpy(draws * 2 + 1))
    return torch.stack(rows)


# ---- compressed token map -----------------------------------------------------------------


def compressed_token_map(
    tokenizer: str | os.PathLike[str] | Tokenizer, compressed_vocab_size: int
) -> torch.Tensor:
    """[vocab] int64: vocabulary id -> compressed id, numbered in order of first appearance.

    A token's key is its decoded text (special tokens included) after NFKC, NFD, accent
    stripping, lowercasing and collapsing whitespace runs to one space, then stripping (a token
    that is just whitespace keeps its single space). A token that decodes to a partial UTF-8
    sequence is keyed by its raw vocabulary string. Raises ConfigError if the map's size is not
    ``compressed_vocab_size`` (engram_compressed_vocab_size): every hash multiplier depends on it,
    so another tokenizer would silently rehash the whole table.
    """
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(os.fspath(tokenizer))
    normalizer = _token_normalizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    key_ids: dict[str, int] = {}
    lookup = []
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(key_ids.setdefault(key, len(key_ids)))
    if len(key_ids) != compressed_vocab_size:
        raise ConfigError(
            f"the tokenizer's {vocab} tokens normalise to {len(key_ids)} compressed ids, but "
            f"engram_compressed_vocab_size is {compressed_vocab_size}: the tokenizer does not "
            "belong to this checkpoint"
        )
    return torch.tensor(lookup, dtype=torch.int64)


def _token_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_KEEPER),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_KEEPER, " "),
        ]
    )


# ---- hash ---------------------------------------------------------------------------------


class EngramHash(nn.Module):
    """Token ids -> table row ids [..., n engram layers, n_cols], for a whole sequence or one
    piece of it. Holds only constants (buffers, so ``.to(device)`` moves them); a request's
    state is its look-back: the compressed ids of its last ``params.lookback`` tokens, filled
    with the pad's compressed id before the sequence starts (``start_lookback``).

    For each position the compressed ids c_0 (the token), c_1 (the one before) ... are
    multiplied by the layer's multipliers and XORed in that order; after c_k is folded in, the
    value is the (k+1)-gram's hash, taken modulo each head's prime and offset by the primes of
    the columns before it, so every (n-gram size, head) owns a disjoint range of rows.
    """

    token_map: torch.Tensor  # [vocab] int64
    multipliers: torch.Tensor  # [n layers, max_ngram] int64
    primes: torch.Tensor  # [n layers, lookback, n_heads] int64
    offsets: torch.Tensor  # [n layers, n_cols] int64

    def __init__(self, params: EngramParams, token_map: torch.Tensor) -> None:
        super().__init__()
        self.params = params
        self.pad_id = int(token_map[params.engram_pad_token_id])
        primes = torch.tensor(params.primes, dtype=torch.int64)
        offsets = primes.cumsum(-1) - primes  # exclusive cumsum within each layer's table
        primes = primes.view(params.n_layers, params.lookback, params.engram_n_heads)
        self.register_buffer("token_map", token_map.to(torch.int64), persistent=False)
        self.register_buffer("multipliers", hash_multipliers(params), persistent=False)
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    @classmethod
    def from_tokenizer(
        cls, params: EngramParams, tokenizer: str | os.PathLike[str] | Tokenizer
    ) -> EngramHash:
        return cls(params, compressed_token_map(tokenizer, params.engram_compressed_vocab_size))

    def start_lookback(self, *batch: int) -> torch.Tensor:
        """[*batch, lookback]: the look-back of a request that has no tokens yet."""
        shape = (*batch, self.params.lookback)
        return torch.full(shape, self.pad_id, dtype=torch.int64, device=self.token_map.device)

    def compress(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[input_ids]

    def row_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A whole sequence from position 0: [T] -> [T, n layers, n_cols]."""
        return self.extend(self.start_lookback(), input_ids)[0]

    def extend(
        self, lookback: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Continue requests by ``input_ids`` [*batch, T] (T >= 1), with their look-backs
        [*batch, lookback]. Returns the row ids [*batch, T, n layers, n_cols] of the new positions
        and the look-backs after them. A prefill chunk is batch () and T tokens; a decode step of
        B requests is batch (B,) and T = 1."""
        n = self.params.engram_max_ngram_size
        history = torch.cat([lookback, self.compress(input_ids)], dim=-1)
        # [*batch, T, max_ngram]: column k is the compressed id k tokens back
        grams = history.unfold(-1, n, 1).flip(-1)
        products = grams.unsqueeze(-2) * self.multipliers  # [*batch, T, n layers, max_ngram]
        rolling, columns = products[..., 0], []
        for k in range(1, n):
            rolling = rolling ^ products[..., k]
            columns.append(rolling.unsqueeze(-1) % self.primes[:, k - 1])
        rows = torch.cat(columns, dim=-1) + self.offsets
        return rows, history[..., -self.params.lookback :]


# ---- layer --------------------------------------------------------------------------------


def dequantize_table(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An Engram table in the checkpoint's form -> float32 [rows, head_dim]: the FP8 E4M3 codes
    [rows, head_dim] times one E8M0 scale per 32 values of a row [rows, head_dim / 32]. The
    reference rounds the result to bf16, which is exact for FP8 codes times powers of two."""
    rows, width = weight.shape
    if tuple(scale.shape) != (rows, width // SCALE_BLOCK):
        raise ValueError(
            f"Engram table scale has shape {list(scale.shape)}, expected "
            f"[{rows}, {width // SCALE_BLOCK}] for a [{rows}, {width}] table"
        )
    blocks = weight.float().unflatten(-1, (-1, SCALE_BLOCK)) * scale.float().unsqueeze(-1)
    return blocks.flatten(-2)


class EngramLayer(nn.Module):
    """Engram before one layer, in fp32: the rows of each position's hash ids, flattened, go
    through ``wkv`` into a key per stream [hc_mult, dim] and one value [dim]; each stream adds
    gate x value, the gate a sigmoid of the signed square root of its normalised dot product
    with its key.

    Parameters, named as DeepSeek's checkpoint under ``layers.{L}.engram.``:
    - ``embed.weight`` [rows, head_dim]: ``embed.weight`` (FP8) dequantised with ``embed.scale``
      (E8M0 per 32 values of a row), see ``dequantize_table``;
    - ``wkv.weight`` [(hc_mult + 1) * dim, n_cols * head_dim]: ``wkv.weight``, dequantised with
      ``wkv.scale`` (E8M0 per 32x32 block) where the checkpoint is FP8;
    - ``q_weight``, ``k_weight`` [hc_mult, dim]: as stored (bf16), widened.
    """

    def __init__(self, params: EngramParams, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.hash_index = params.engram_layer_ids.index(layer_id)  # its slot in the hash ids
        self.dim, self.hc, self.eps = params.hidden_size, params.hc_mult, params.rms_norm_eps
        rows = params.engram_num_embeddings[self.hash_index]
        width = params.n_cols * params.engram_head_dim
        self.embed = nn.utils.skip_init(nn.Embedding, rows, params.engram_head_dim)
        self.wkv = nn.utils.skip_init(nn.Linear, width, (self.hc + 1) * self.dim, bias=False)
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, hc_mult, dim] float32, hash_ids [T, n_cols] (this layer's slot of
        ``EngramHash`` row ids) -> the updated streams [T, hc_mult, dim]."""
        rows = F.embedding(hash_ids, self.embed.weight).flatten(-2)  # [T, n_cols * head_dim]
        key, value = self.wkv(rows).split([self.hc * self.dim, self.dim], dim=-1)
        key = key.unflatten(-1, (self.hc, self.dim))  # [T, hc_mult, dim]
        # NOTE: each stream and its key are normalised on their own, over dim
        rstd = torch.rsqrt(streams.square().mean(-1) + self.eps) * torch.rsqrt(
            key.square().mean(-1) + self.eps
        )
        dot = (streams * (self.q_weight * self.k_weight) * key).sum(-1) * rstd * self.dim**-0.5
        # copysign, not sign: a dot of exactly 0 still gets sqrt(GATE_FLOOR), as the reference
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
        return streams + gate.unsqueeze(-1) * value.unsqueeze(-2)  # [T, hc_mult, dim]
