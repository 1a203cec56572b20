"""ForwardBatch: what one model forward needs to know about the sequences in it.

The caller (the engine, or :func:`prompt_logits`) owns the paged latent cache and decides where
every new token's latent goes (``slot_mapping``) and which blocks each sequence reads
(``block_tables``). Tensors are built once per forward and shared by every layer.

Each sequence runs on one of two attention paths:
- *expanded* (prefill): the context's latents are expanded through ``kv_b_proj`` into per-head
  keys and values, then causal attention;
- *absorbed* (decode): ``W_UK`` is folded into the query and attention runs on the latent cache
  itself (MQA over ``c_kv ‖ k_rope``), ``W_UV`` applied after.
``attention="auto"`` sends single-token queries to the absorbed path and the rest to the expanded
one; "expanded" / "absorbed" force one path for every token (tests compare the two).
DeepSeek-V4 has one path for all (``attention_path = "expanded"``); each of its sequences also
names the state slot that holds its window and compressor rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

AttentionPath = Literal["auto", "expanded", "absorbed"]


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence on the expanded path: new tokens [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    ctx_len: int  # context after this step, new tokens included
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] int64
    state_slot: int = -1  # DeepSeek-V4's per-request state; -1: none
    # (position, snapshot id): copy the state slot into the snapshot at that many tokens
    snapshots: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class DecodeQueries:
    """Queries on the absorbed path, one row each."""

    token_index: torch.Tensor  # [num_queries] position of the query in the flat batch
    block_tables: torch.Tensor  # [num_queries, max_blocks] int64, -1 padded
    seq_lens: torch.Tensor  # [num_queries] context length the query sees (itself included)


@dataclass(frozen=True)
class GraphStep:
    """A decode step as a captured graph takes it: one new token per sequence, every shape from
    the inputs, no host sync (``MoECausalLM.decode_graph``)."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]: the new token's; the context is positions + 1 tokens
    slots: torch.Tensor  # [B] state slots (models with state; ignored by the others)
    # [B, W] blocks, padded with any valid block: W * block_size may pass the longest context
    block_tables: torch.Tensor
    expert_counts: torch.Tensor  # [num_moe_layers * n_routed_experts] int64, added into
    block_size: int


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    prefill: tuple[PrefillSpan, ...]
    decode: DecodeQueries | None
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        num_computed_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        attention: AttentionPath = "auto",
        device: torch.device | str = "cpu",
        state_slots: Sequence[int] | None = None,
        snapshots: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> ForwardBatch:
        """Sequence i brings ``query_lens[i]`` new tokens after ``num_computed_tokens[i]`` cached
        ones; ``block_tables[i]`` must cover all of them; ``state_slots[i]``: its state slot;
        ``snapshots[i]``: where its state is copied for the prefix cache."""
        if not len(query_lens) == len(num_computed_tokens) == len(block_tables):
            raise ValueError("query_lens, num_computed_tokens and block_tables differ in length")
        seq_slots = list(state_slots) if state_slots is not None else [-1] * len(query_lens)
        if len(seq_slots) != len(query_lens):
            raise ValueError("state_slots and query_lens differ in length")
        seq_snaps = [tuple(x) for x in snapshots] if snapshots else [()] * len(query_lens)
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        dec_index: list[int] = []
        dec_tables: list[Sequence[int]] = []
        dec_lens: list[int] = []
        for q_len, done, table, slot, snaps in zip(
            query_lens, num_computed_tokens, block_tables, seq_slots, seq_snaps, strict=True
        ):
            ctx_len = done + q_len
            if q_len <= 0 or len(table) * block_size < ctx_len:
                raise ValueError(
                    f"sequence of {ctx_len} tokens needs more than {len(table)} blocks"
                )
            start = len(positions)
            for pos in range(done, ctx_len):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            absorbed = attention == "absorbed" or (attention == "auto" and q_len == 1)
            if absorbed:
                dec_index.extend(range(start, start + q_len))
                dec_tables.extend([table] * q_len)
                dec_lens.extend(range(done + 1, ctx_len + 1))
            else:
                n_blocks = (ctx_len + block_size - 1) // block_size
                ids = torch.tensor(table[:n_blocks], dtype=torch.long, device=device)
                spans.append(PrefillSpan(start, start + q_len, ctx_len, ids, slot, snaps))
        decode = None
        if dec_index:
            width = max(len(t) for t in dec_tables)
            padded = [list(t) + [-1] * (width - len(t)) for t in dec_tables]
            decode = DecodeQueries(
                token_index=torch.tensor(dec_index, dtype=torch.long, device=device),
                block_tables=torch.tensor(padded, dtype=torch.long, device=device),
                seq_lens=torch.tensor(dec_lens, dtype=torch.long, device=device),
            )
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            prefill=tuple(spans),
            decode=decode,
            block_size=block_size,
        )
