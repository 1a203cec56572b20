"""What every Ferry model shares around its decoder: the expert placement, joining a DEP group,
counting expert load, the routing-skew test knob, the idle MoE pass, and the logits head."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ferry.services.engine.expert_load import ExpertLoad
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.cache_spec import CacheSpec
from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.forward_batch import AttentionPath, GraphStep
from ferry.services.engine.model.moe import HashRouter, MoE

if TYPE_CHECKING:
    from ferry.services.engine.model.registry import AnyModelConfig


class MoECausalLM(nn.Module):
    """Subclasses build ``self.lm_head`` and name their decoder layers (``decoder_layers``),
    each with its MoE or MLP as ``.mlp``."""

    config: AnyModelConfig
    lm_head: nn.Linear
    attention_path: AttentionPath = "auto"  # how the engine builds its ForwardBatch
    # parameters the loader keeps in float32 whatever the model's dtype: a dotted name holding
    # one of these parts (the MoE routers are float32 in every family)
    keep_fp32: tuple[str, ...] = ()

    def __init__(self, config: AnyModelConfig, placement: ExpertPlacement | None) -> None:
        """``placement``: which experts this rank holds; None: every one, once."""
        super().__init__()
        layers = config.num_moe_layers
        if placement is None:
            placement = ExpertPlacement.identity(layers, config.n_routed_experts)
        if placement.num_moe_layers != layers:
            raise ValueError(
                f"placement covers {placement.num_moe_layers} MoE layers, model has {layers}"
            )
        self.config = config
        self.placement = placement

    def decoder_layers(self) -> Iterable[nn.Module]:
        raise NotImplementedError

    def attach_checkpoint_files(self, path: Path) -> None:
        """Read what the model needs from its checkpoint's folder besides the weights (V4.1's
        Engram: the tokenizer). Nothing, for most families."""

    def set_kv_cache_dtype(self, name: str) -> None:
        """How the cache stores what attention keeps (``--kv-cache-dtype``): ``auto``, the
        model's dtype, for every family; ``fp8`` where the family has that format."""
        if name != "auto":
            raise ConfigError(
                f"--kv-cache-dtype {name}: {type(self).__name__} has only the model's dtype "
                "(auto); an FP8 cache exists for DeepSeek-V4.1"
            )

    def cache_spec(self) -> CacheSpec:
        """What the model keeps per token (paged groups) and per request (state rings)."""
        raise NotImplementedError

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_slots: int, num_snapshots: int = 0
    ) -> Any:
        """A zeroed cache of ``num_blocks`` blocks, ``num_slots`` state slots and
        ``num_snapshots`` snapshots of them, passed to ``forward`` as it is."""
        raise NotImplementedError

    def kv_blocks(self, kv_cache: Any) -> torch.Tensor:
        """``kv_cache``'s blocks as KV transports move them: [layers, blocks, block_size, dim],
        a block's bytes in each layer one run (a one-group cache is that tensor itself)."""
        return kv_cache

    # whether ``decode_graph`` exists: a decode step a graph can capture (decode_graphs.py)
    has_decode_graph = False

    def graph_inputs(self, kv_cache: Any) -> tuple[torch.Tensor, ...]:
        """``kv_cache``'s tensors as a decode graph takes them (and writes into them)."""
        raise NotImplementedError

    def decode_graph(
        self, step: GraphStep, kv_cache: Any, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """One new token per sequence with static structure: no host sync, no Python that
        depends on the data. ``inputs``: ``graph_inputs(kv_cache)``, or a graph's inputs
        standing for them (``kv_cache`` gives only their layout). Returns float32 logits
        [B, vocab]; adds each learned MoE layer's choices into ``step.expert_counts`` (the
        hash-routed ones count from the tokens, ``ExpertLoad.add_tokens``)."""
        raise NotImplementedError

    @staticmethod
    def count_choices(
        step: GraphStep, choices: Sequence[torch.Tensor | None], experts: int
    ) -> None:
        """Add each MoE layer's logical choices [B, top_k] (None: not counted here) into
        ``step.expert_counts``. A comparison summed, which inductor fuses into one loop:
        ``index_add_`` is a fallback call out of the compiled code."""
        ids = torch.arange(experts, device=step.expert_counts.device)
        rows = [
            torch.zeros_like(ids) if c is None else (c[..., None] == ids).sum((0, 1))
            for c in choices
        ]
        step.expert_counts.add_(torch.stack(rows).reshape(-1))

    def moe_layers(self) -> list[MoE]:
        mlps = (getattr(layer, "mlp", None) for layer in self.decoder_layers())
        return [mlp for mlp in mlps if isinstance(mlp, MoE)]

    def attach_ep_group(self, group: EPGroup) -> None:
        """Make this model a rank of a DEP group: its MoE layers exchange tokens with the other
        ranks (the placement must say the same ep_size and ep_rank)."""
        p = self.placement
        if (p.ep_size, p.ep_rank) != (group.size, group.rank):
            raise ValueError(
                f"placement is rank {p.ep_rank} of {p.ep_size}, the group says "
                f"rank {group.rank} of {group.size}"
            )
        for moe in self.moe_layers():
            moe.ep_group = group

    def attach_expert_load(self, load: ExpertLoad) -> None:
        """Count every MoE layer's routing into ``load``; hash-routed layers by token id."""
        tables = {}
        for moe in self.moe_layers():
            moe.expert_load = load
            if isinstance(moe.gate, HashRouter):
                tables[moe.moe_layer] = moe.gate.tid2eid
        load.count_by_token(tables)

    def skew_routing(self, skew: float) -> None:
        """A test knob: add a seeded ``skew * N(0, 1)`` per expert to every learned MoE layer's
        correction bias, which steers which experts the router picks (not their weights), so
        that a few experts get most tokens, as in real traffic. The same in every process.
        Hash-routed layers pick by token id: nothing steers them."""
        for moe in self.moe_layers():
            bias = moe.correction_bias
            if bias is not None:
                gen = torch.Generator().manual_seed(1000 + moe.moe_layer)
                bias += skew * torch.randn(bias.shape, generator=gen).to(bias.device)

    def idle_moe_pass(self) -> None:
        """A DEP rank with nothing to run this step: join every MoE layer's exchange with no
        tokens, in layer order, so that the other ranks' steps can complete."""
        empty = torch.empty(0, self.lm_head.in_features, dtype=self.dtype, device=self.device)
        no_ids = torch.empty(0, dtype=torch.long, device=self.device)
        for moe in self.moe_layers():
            moe(empty, no_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab_size] float32."""
        return self.lm_head(hidden).float()
