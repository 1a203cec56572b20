"""Weights: HF safetensors checkpoints (one file or an index of shards, bf16/fp32 or FP8 e4m3
block-quantized, FP4 routed experts), the seeded presets, and export of a preset as a checkpoint.
Every family alike: the config's ``model_type`` picks the family (``registry``), whose model class
is built and whose ``checkpoint_names`` say which tensors to expect and how they are named.

A preset of a family with a released layout (``RELEASED_LAYOUTS``: DeepSeek-V4.1) is exported in
it, FP8/FP4 with E8M0 scales and BF16, and its random weights are generated on that format's grid,
so that the preset and its export are the same model; the others are exported in float32.

Every error names the file and the tensor at fault; none is a bare KeyError.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ferry.services.common.log import get_logger
from ferry.services.common.tokenizer import write_byte_tokenizer_json
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.config import FP4_BLOCK, ConfigError
from ferry.services.engine.model.moe import MoE
from ferry.services.engine.model.presets import PRESETS, Preset
from ferry.services.engine.model.registry import (
    AnyModelConfig,
    CheckpointNames,
    config_from_hf_dict,
    family_of,
)
from ferry.services.engine.model.v41.quant import fp4_dequant, quantize_fp4, quantize_fp8_blocks

log = get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's FP8 scales: float32, beside the weight's name
E8M0_SCALE = ".scale"  # DeepSeek-V4's: `X.scale` in E8M0 (powers of two) for `X.weight`
FP8_DTYPES = (torch.float8_e4m3fn,)
# FP4 e2m1, two per byte (the even index in the low nibble), as DeepSeek-V4's routed experts
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
# a routed expert's tensor by Ferry's name, in every family: rows of the slot-stacked parameters
# of a decoder layer, or of a drafter's block (V4.1's DSpark stages, every expert in its slot)
EXPERT_RE = re.compile(
    r"model\.(layers|dspark)\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight"
)

# How a tensor is stored in a released checkpoint: FP8 e4m3 and FP4 e2m1 with E8M0 scales, BF16,
# F32 (as generated: float32, or an integer table). DENSE: FP8 in a quantized checkpoint, else
# BF16; EXPERT: FP4 where the config's expert_dtype says so, else DENSE.
FP8, FP4, BF16, F32, DENSE, EXPERT = "fp8", "fp4", "bf16", "f32", "dense", "expert"
Layout = tuple[tuple[re.Pattern[str], str], ...]
# By model_type, Ferry's tensor names -> how the family's released checkpoints store them: the
# first pattern that matches decides, the rest are BF16. Families without one export float32.
RELEASED_LAYOUTS: dict[str, Layout] = {
    # v41-golden's README, "Checkpoint format"
    "deepseek_v41": (
        (EXPERT_RE, EXPERT),
        (re.compile(r"\.engram\.embed\.weight$"), FP8),  # FP8 rows even in a bf16 checkpoint
        (re.compile(r"\.self_attn\.(q_a|q_b|kv|o_a|o_b|indexer\.q_b)_proj\.weight$"), DENSE),
        (re.compile(r"\.(shared_experts\.\w+_proj|engram\.wkv|main_proj)\.weight$"), DENSE),
        (re.compile(r"\.(sinks|e_score_correction_bias)$|_hc\.(fn|base|scale)$"), F32),
    ),
}


class LoaderError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


def read_config(path: Path) -> AnyModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise LoaderError(f"{path}: no config.json (is this a HF checkpoint directory?)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise LoaderError(f"{cfg_file}: not valid JSON ({e})") from None
    try:
        return config_from_hf_dict(raw, source=str(cfg_file))
    except ConfigError as e:
        raise LoaderError(str(e)) from None


def build_empty_model(
    config: AnyModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    placement: ExpertPlacement | None,
) -> MoECausalLM:
    """Uninitialised parameters in ``dtype``; the router stays float32, and so do the
    parameters the model class keeps in float32 (``keep_fp32``)."""
    if placement is None:  # made here, not under the meta device: it checks its values
        placement = ExpertPlacement.identity(config.num_moe_layers, config.n_routed_experts)
    model_class = family_of(config).model_class()
    with torch.device("meta"):
        model = model_class(config, placement)
    model.to_empty(device=device)
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, MoE):
            m.gate.float()
    if model.keep_fp32:
        keep = re.compile(r"(^|\.)(" + "|".join(model.keep_fp32) + r")(\.|$)")
        for name, param in model.named_parameters():
            if keep.search(name):
                param.data = param.data.float()
    return model.eval().requires_grad_(False)


class _Targets:
    """Where each checkpoint tensor goes in the model: a parameter, or expert slot rows."""

    def __init__(self, model: MoECausalLM) -> None:
        self.config = config = model.config
        self.placement = model.placement
        self.state = dict(model.named_parameters()) | dict(model.named_buffers())
        self.expected = family_of(config).checkpoint_names().checkpoint_shapes(config)
        self.seen: set[str] = set()
        moe_ids = config.moe_layer_ids
        self._moe_index = {layer: i for i, layer in enumerate(moe_ids)}
        # (moe layer, logical expert) -> local slot rows holding it
        self._slots: dict[tuple[int, int], list[int]] = {}
        for i in range(model.placement.num_moe_layers):
            for local, expert in enumerate(model.placement.local_experts(i)):
                self._slots.setdefault((i, expert), []).append(local)

    def load(self, name: str, tensor: torch.Tensor, file: str) -> None:
        want = self.expected.get(name)
        if want is None:
            raise LoaderError(
                f"{file}: unknown tensor '{name}' for a {self.config.num_hidden_layers}-layer "
                f"{self.config.model_type}"
            )
        if tuple(tensor.shape) != want:
            raise LoaderError(
                f"{file}: tensor '{name}' has shape {list(tensor.shape)}, config.json implies {list(want)}"
            )
        if name in self.seen:
            raise LoaderError(f"{file}: tensor '{name}' appears twice in the checkpoint")
        self.seen.add(name)
        if name.endswith(".tid2eid"):
            bad = (tensor < 0) | (tensor >= self.config.n_routed_experts)
            if bool(bad.any()):
                raise LoaderError(
                    f"{file}: '{name}' routes to expert {int(tensor[bad][0])}, outside "
                    f"0..{self.config.n_routed_experts - 1}"
                )
        m = EXPERT_RE.fullmatch(name)
        if m is None:
            with torch.no_grad():
                self.state[name].copy_(tensor)
            return
        block, layer, expert, proj = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        prefix = f"model.{block}.{layer}.mlp.experts."
        inter = self.config.moe_intermediate_size
        if block == "dspark":
            slots = [expert]
        else:
            slots = self._slots.get((self._moe_index[layer], expert), [])
        for slot in slots:
            with torch.no_grad():
                if proj == "down":
                    self.state[prefix + "w2"][slot].copy_(tensor)
                else:
                    rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
                    self.state[prefix + "w13"][slot, rows].copy_(tensor)

    def finish(self, where: str) -> None:
        missing = [n for n in self.expected if n not in self.seen]
        if missing == ["lm_head.weight"] and self.config.tie_word_embeddings:
            with torch.no_grad():
                self.state["lm_head.weight"].copy_(self.state["model.embed_tokens.weight"])
            return
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise LoaderError(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}")


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str, file: str
) -> torch.Tensor:
    """weight [rows, cols] e4m3 times its per-block scale [ceil(rows/b0), ceil(cols/b1)]
    (float32 or E8M0: both multiply); ``name``: the scale's, for errors."""
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise LoaderError(
            f"{file}: '{name}' has shape {list(scale_inv.shape)}, "
            f"expected {list(want)} for {block[0]}x{block[1]} blocks"
        )
    scale = (
        scale_inv.float()
        .repeat_interleave(block[0], 0)[:rows]
        .repeat_interleave(block[1], 1)[:, :cols]
    )
    return weight.float() * scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, name: str, file: str) -> torch.Tensor:
    """packed [rows, cols / 2] (two e2m1 codes a byte) times one E8M0 scale per 32 values
    [rows, cols / 32] -> float32 [rows, cols]; ``name``: the scale's, for errors."""
    rows, half = packed.shape
    cols = 2 * half
    if tuple(scale.shape) != (rows, math.ceil(cols / FP4_BLOCK)):
        raise LoaderError(
            f"{file}: '{name}' has shape {list(scale.shape)}, expected "
            f"[{rows}, {math.ceil(cols / FP4_BLOCK)}] for FP4 in blocks of {FP4_BLOCK}"
        )
    return fp4_dequant(packed, scale, FP4_BLOCK)


def _shard_map(path: Path) -> dict[str, str]:
    """tensor name -> shard file name."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoaderError(f"{index}: not a safetensors index ({e})") from None
        for tensor, shard in weight_map.items():
            if not (path / shard).exists():
                raise LoaderError(
                    f"{path}: shard '{shard}' listed in {INDEX_FILE} is missing (it holds '{tensor}')"
                )
        return weight_map
    single = path / SINGLE_FILE
    if not single.exists():
        raise LoaderError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def _read_tensors(path: Path, config: AnyModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for every tensor Ferry uses, by Ferry's name, FP8/FP4 weights
    already dequantized."""
    names = family_of(config).checkpoint_names()
    for name, tensor, file in _read_stored(path, config, names):
        for part, t in names.ferry_tensors(name, tensor):
            yield part, t, file


def _read_stored(
    path: Path, config: AnyModelConfig, names: CheckpointNames
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name as stored, tensor, file), FP8/FP4 weights dequantized, scales consumed."""
    weight_map = _shard_map(path)
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(name: str) -> torch.Tensor:
            shard = weight_map[name]
            if shard not in handles:
                handles[shard] = stack.enter_context(safe_open(str(path / shard), framework="pt"))
            tensor: torch.Tensor = handles[shard].get_tensor(name)
            return tensor

        scales = {s for n in weight_map for s in _scale_names(n) if s in weight_map}
        _log_not_loaded([n for n in weight_map if names.is_ignored(n, config)], str(path))
        for name in sorted(weight_map, key=lambda n: (weight_map[n], n)):
            if name in scales or names.is_ignored(name, config):
                continue
            tensor, file = get(name), weight_map[name]
            scale = name.removesuffix(".weight") + E8M0_SCALE
            if tensor.dtype in FP4_DTYPES and name.endswith(".weight") and scale in weight_map:
                tensor = dequantize_fp4(tensor, get(scale), scale, file)
            elif tensor.dtype in FP8_DTYPES:
                found = [s for s in _scale_names(name) if s in weight_map]
                if not found:
                    want = " or ".join(f"'{s}'" for s in _scale_names(name))
                    raise LoaderError(f"{file}: FP8 tensor '{name}' has no {want}")
                block = names.fp8_block(name, config)
                tensor = dequantize_fp8(tensor, get(found[0]), block, found[0], file)
            yield name, tensor, file


def _log_not_loaded(names: list[str], where: str) -> None:
    """One line for the stored tensors Ferry does not load (a text-only model's vision tower,
    drafter layers), counted by their first name part."""
    if not names:
        return
    counts = Counter(n.split(".")[0] for n in names)
    parts = ", ".join(f"{k}.* ({v})" for k, v in sorted(counts.items()))
    log.info("checkpoint tensors not loaded", where=where, count=len(names), parts=parts)


def _scale_names(name: str) -> list[str]:
    """Where an FP8 weight's scale may be: ``X_scale_inv``, or ``X.scale`` for ``X.weight``
    (a ``.scale`` without a ``.weight`` beside it is a tensor of its own)."""
    names = [name + SCALE_SUFFIX]
    if name.endswith(".weight"):
        names.append(name.removesuffix(".weight") + E8M0_SCALE)
    return names


def load_weights(
    model: MoECausalLM, tensors: Iterable[tuple[str, torch.Tensor, str]], where: str
) -> MoECausalLM:
    targets = _Targets(model)
    for name, tensor, file in tensors:
        targets.load(name, tensor, file)
    targets.finish(where)
    return model


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
) -> MoECausalLM:
    path = Path(path)
    config = read_config(path)
    model = build_empty_model(config, dtype, device, placement)
    model.attach_checkpoint_files(path)
    return load_weights(model, _read_tensors(path, config), str(path))


def load_preset(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
) -> MoECausalLM:
    preset = PRESETS[name]
    model = build_empty_model(preset.config, dtype, device, placement)
    # what its export holds beside the weights: the byte tokenizer (V4.1's Engram reads it)
    with tempfile.TemporaryDirectory(prefix="ferry-preset-") as folder:
        write_byte_tokenizer_json(Path(folder))
        model.attach_checkpoint_files(Path(folder))
    tensors = ((n, t, f"preset:{name}") for n, t in random_state_dict(preset).items())
    return load_weights(model, tensors, f"preset:{name}")


def save_checkpoint(
    config: AnyModelConfig,
    state: dict[str, torch.Tensor],
    path: str | Path,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json and safetensors (sharded with an index past ``max_shard_bytes``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    state = {k: v.contiguous() for k, v in state.items()}
    if max_shard_bytes is None:
        save_file(state, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def export_preset(name: str, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write preset ``name`` as a checkpoint in its family's released layout (names, dtypes,
    config.json, the byte tokenizer's tokenizer.json), which Ferry loads, and transformers for
    the families it implements."""
    preset = PRESETS[name]
    names = family_of(preset.config).checkpoint_names()
    state: dict[str, torch.Tensor] = {}
    for n, t in random_state_dict(preset).items():
        state.update(_released(n, t, preset.config, names))
    save_checkpoint(preset.config, state, path, max_shard_bytes)
    write_byte_tokenizer_json(Path(path))
    return Path(path)


def random_state_dict(preset: Preset) -> dict[str, torch.Tensor]:
    """Ferry-named float32 weights: N(0, init_std) matrices (V4.1's Engram tables too, as the
    token embeddings), unit norms, a small routing bias; for DeepSeek-V4 and V4.1 also
    attention sinks, mHC bases and scales that are not their trivial values; V4's slot biases
    and token-to-experts table (distinct experts per token); V4.1's Engram q/k weights near 1.
    A family with a released layout gets each tensor on its stored format's grid
    (``_on_grid``)."""
    gen = torch.Generator().manual_seed(preset.seed)
    config = preset.config
    names = family_of(config).checkpoint_names()
    shapes = names.checkpoint_shapes(config)
    return {
        name: _on_grid(name, _random_tensor(name, shape, preset, gen), config, names)
        for name, shape in sorted(shapes.items())
    }


def _random_tensor(
    name: str, shape: tuple[int, ...], preset: Preset, gen: torch.Generator
) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("e_score_correction_bias"):
        return (torch.rand(shape, generator=gen) - 0.5) * 0.04
    if leaf == "tid2eid":
        experts = preset.config.n_routed_experts
        return torch.stack(
            [torch.randperm(experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        )
    if leaf in ("sinks", "position_bias", "base", "hc_base"):
        return torch.randn(shape, generator=gen) * 0.5
    if leaf in ("scale", "hc_scale", "q_weight", "k_weight"):
        return 1 + torch.randn(shape, generator=gen) * 0.1
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * preset.init_std


def _stored_as(name: str, config: AnyModelConfig) -> str:
    """FP8, FP4, BF16 or F32: how the family's released checkpoints store Ferry's ``name``
    (F32 for a family without a released layout)."""
    layout = RELEASED_LAYOUTS.get(config.model_type)
    if layout is None:
        return F32
    kind = next((k for pattern, k in layout if pattern.search(name)), BF16)
    if kind == EXPERT:
        kind = FP4 if getattr(config, "expert_dtype", "") == "fp4" else DENSE  # V3: no such field
    if kind == DENSE:
        kind = FP8 if config.fp8_block_size is not None else BF16
    return kind


def _released(
    name: str, t: torch.Tensor, config: AnyModelConfig, names: CheckpointNames
) -> dict[str, torch.Tensor]:
    """Ferry's float32 tensor ``name`` as the released checkpoint stores it, by stored name:
    the weight, and for FP8 and FP4 its E8M0 scales ``X.scale`` beside ``X.weight``."""
    stored = names.stored_name(name)
    kind = _stored_as(name, config)
    if kind == FP8:
        weight, scale = quantize_fp8_blocks(t, names.fp8_block(stored, config))
    elif kind == FP4:
        weight, scale = quantize_fp4(t)
    else:
        return {stored: t.bfloat16() if kind == BF16 else t}
    return {stored: weight, stored.removesuffix(".weight") + E8M0_SCALE: scale}


def _on_grid(
    name: str, t: torch.Tensor, config: AnyModelConfig, names: CheckpointNames
) -> torch.Tensor:
    """``t`` as loading its released form gives it back: float32 values that form holds
    exactly, so exporting them and loading the export changes nothing."""
    stored = _released(name, t, config, names)
    weight = stored.pop(names.stored_name(name))
    if not stored:
        return weight.to(t.dtype)
    ((scale_name, scale),) = stored.items()
    if weight.dtype in FP8_DTYPES:
        block = names.fp8_block(names.stored_name(name), config)
        return dequantize_fp8(weight, scale, block, scale_name, f"preset weight {name}")
    return dequantize_fp4(weight, scale, scale_name, f"preset weight {name}")
