"""Weights: HF safetensors checkpoints (one file or an index of shards, bf16/fp32 or FP8 e4m3
block-quantized, FP4 routed experts), the seeded presets, and export of a preset as a checkpoint.
Every family alike: the config's ``model_type`` picks the family (``registry``), whose model class
is built and whose ``checkpoint_names`` say which tensors to expect and how they are named.

Every error names the file and the tensor at fault; none is a bare KeyError.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.causal_lm import MoECausalLM
from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.moe import MoE
from ferry.services.engine.model.presets import PRESETS, Preset
from ferry.services.engine.model.registry import (
    AnyModelConfig,
    CheckpointNames,
    config_from_hf_dict,
    family_of,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's FP8 scales: float32, beside the weight's name
E8M0_SCALE = ".scale"  # DeepSeek-V4's: `X.scale` in E8M0 (powers of two) for `X.weight`
FP8_DTYPES = (torch.float8_e4m3fn,)
# FP4 e2m1, two per byte (the even index in the low nibble), as DeepSeek-V4's routed experts
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
FP4_BLOCK = 32  # values per E8M0 scale, along a row
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes; bit 3 is the sign
# a routed expert's tensor by Ferry's name, in every family: rows of the slot-stacked parameters
EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


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
        layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        prefix = f"model.layers.{layer}.mlp.experts."
        inter = self.config.moe_intermediate_size
        for slot in self._slots.get((self._moe_index[layer], expert), []):
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
    codes = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(rows, cols)  # low nibble first
    table = torch.tensor([*E2M1, *(-v for v in E2M1)])
    tiles = scale.float().repeat_interleave(FP4_BLOCK, 1)[:, :cols]
    return table[codes] * tiles


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
                block = config.fp8_block_size or (128, 128)
                tensor = dequantize_fp8(tensor, get(found[0]), block, found[0], file)
            yield name, tensor, file


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
    return load_weights(model, _read_tensors(path, config), str(path))


def load_preset(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
) -> MoECausalLM:
    preset = PRESETS[name]
    model = build_empty_model(preset.config, dtype, device, placement)
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
    """Write preset ``name`` as a HF checkpoint that transformers and Ferry both load."""
    from ferry.services.common.tokenizer import write_byte_tokenizer_json

    preset = PRESETS[name]
    names = family_of(preset.config).checkpoint_names()
    state = {names.stored_name(n): t for n, t in random_state_dict(preset).items()}
    save_checkpoint(preset.config, state, path, max_shard_bytes)
    write_byte_tokenizer_json(Path(path))
    return Path(path)


def random_state_dict(preset: Preset) -> dict[str, torch.Tensor]:
    """Ferry-named float32 weights: N(0, init_std) matrices, unit norms, a small routing bias;
    for DeepSeek-V4 also attention sinks, slot biases, mHC bases and scales that are not their
    trivial values, and a token-to-experts table (distinct experts per token)."""
    gen = torch.Generator().manual_seed(preset.seed)
    config = preset.config
    shapes = family_of(config).checkpoint_names().checkpoint_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = (torch.rand(shape, generator=gen) - 0.5) * 0.04
        elif leaf == "tid2eid":
            experts = config.n_routed_experts
            t = torch.stack(
                [torch.randperm(experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
            )
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            t = torch.randn(shape, generator=gen) * 0.5
        elif leaf in ("scale", "hc_scale"):
            t = 1 + torch.randn(shape, generator=gen) * 0.1
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * preset.init_std
        out[name] = t
    return out
