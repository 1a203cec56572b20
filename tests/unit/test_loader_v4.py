"""DeepSeek-V4 checkpoints: both naming schemes (DeepSeek's, transformers'), the MTP layer
skipped, the token-to-experts table checked, FP8 dense weights with E8M0 `.scale` and FP4 routed
experts as DeepSeek ships V4-Flash, and presets exported as checkpoints transformers loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferry.services.engine.model import LoaderError, export_preset, load_model, prompt_logits
from ferry.services.engine.model.presets import PRESETS
from ferry.services.engine.model.v4 import checkpoint_names as names
from tests.helpers import quantize_fp4_blocks, quantize_fp8_blocks, rel_err, rewrite_config
from tests.helpers_v4 import make_v4_model, v4_hf_logits

IDS = [(7 * i + 3) % 250 + 2 for i in range(45)]


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sb = b.state_dict()
    for name, t in a.state_dict().items():
        assert torch.equal(t, sb[name]), name


@pytest.mark.parametrize("preset", ["v4-tiny", "v4-small"])
def test_every_name_round_trips_between_the_schemes(preset: str) -> None:
    for name in names.checkpoint_shapes(PRESETS[preset].config):  # type: ignore[arg-type]
        theirs = names.deepseek_name(name)
        assert names.canonical(theirs) == name == names.canonical(name), (name, theirs)
        assert not theirs.startswith("model.") and "self_attn" not in theirs, theirs


def test_an_exported_preset_is_deepseeks_layout_that_transformers_loads(tmp_path: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    path = export_preset("v4-tiny", tmp_path)
    stored = set(load_file(str(path / "model.safetensors")))
    for name in (
        "embed.weight",
        "head.weight",
        "hc_head_fn",
        "layers.0.hc_attn_fn",
        "layers.0.ffn.gate.tid2eid",
        "layers.1.attn.attn_sink",
        "layers.1.attn.compressor.ape",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.1.attn.indexer.weights_proj.weight",
        "layers.2.ffn.gate.bias",
        "layers.2.ffn.experts.3.w1.weight",
    ):
        assert name in stored, name
    hf, info = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_model("v4-tiny")
    assert rel_err(prompt_logits(ours, IDS), v4_hf_logits(hf.eval(), IDS)) < 1e-4
    _state_equal(ours, load_model(path))


def test_the_spellings_load_the_same_model(tmp_path: Path) -> None:
    """save_pretrained's names; transformers' module names with fused experts; DeepSeek's."""
    model = make_v4_model(seed=4)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    config = (saved / "config.json").read_text()
    modules = dict(model.state_dict())
    ferry_named: dict[str, torch.Tensor] = {}
    for name, t in modules.items():
        ferry_named.update(names.split_fused_experts(name, t))
    spellings = {
        "modules": modules,
        "deepseek": {names.deepseek_name(n): t for n, t in ferry_named.items()},
    }
    reference = load_model(saved)
    assert rel_err(prompt_logits(reference, IDS), v4_hf_logits(model, IDS)) < 1e-4
    for label, state in spellings.items():
        path = tmp_path / label
        path.mkdir()
        (path / "config.json").write_text(config)
        save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
        _state_equal(load_model(path), reference)


def test_mtp_and_drafter_tensors_are_skipped(tmp_path: Path) -> None:
    path = export_preset("v4-tiny", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state["mtp.0.e_proj.weight"] = torch.zeros(4, 4)
    state["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    state["mtp.0.ffn.experts.0.w1.weight"] = torch.zeros(2, 2)
    state["dspark.fc.weight"] = torch.zeros(2, 2)
    save_file(state, str(path / "model.safetensors"))
    rewrite_config(path, num_nextn_predict_layers=1)
    _state_equal(load_model(path), load_model("v4-tiny"))


def test_a_token_routed_outside_the_experts_is_refused(tmp_path: Path) -> None:
    path = export_preset("v4-tiny", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state["layers.1.ffn.gate.tid2eid"][5, 1] = 16
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(LoaderError, match=r"'model.layers.1.mlp.gate.tid2eid' routes to expert 16"):
        load_model(path)


def _fp8_dense(name: str, t: torch.Tensor) -> bool:
    """What V4-Flash stores as FP8: the attention and shared-expert linears (not the
    compressors, indexer, router, embeddings or mHC, which ship BF16/FP32)."""
    dense = (".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", ".shared_experts.")
    return t.dim() == 2 and any(d in name for d in dense) and ".compressor." not in name


def test_fp8_dense_and_fp4_experts_as_deepseek_ships_them(tmp_path: Path) -> None:
    """Dense linears in 128x128 e4m3 blocks with E8M0 `.scale`, routed experts in e2m1 (two a
    byte, int8) with an E8M0 scale per 32: each loaded weight is the dequantized one exactly
    and within the format's error of the original."""
    path = export_preset("v4-tiny", tmp_path)
    original: dict[str, torch.Tensor] = load_file(str(path / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}  # Ferry's name -> the value the loader must give
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    table = torch.cat([table, -table])
    for name, t in original.items():
        scale_name = name.removesuffix(".weight") + ".scale"
        if ".ffn.experts." in name:
            packed, scale = quantize_fp4_blocks(t)
            stored[name], stored[scale_name] = packed.view(torch.int8), scale
            step = scale.float().repeat_interleave(32, 1)[:, : t.shape[1]]
            codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(t.shape).long()
            deq = table[codes] * step
            assert bool(((deq - t).abs() <= step).all()), name  # half of 6-4, scaled
        elif _fp8_dense(name, t):
            q, scale = quantize_fp8_blocks(t, e8m0=True)
            stored[name], stored[scale_name] = q, scale
            tiles = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
            tiles = tiles[: t.shape[0], : t.shape[1]]
            deq = q.float() * tiles
            # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 of the tile's scale
            assert bool(((deq - t).abs() <= (t.abs() / 16).clamp(min=tiles * 2**-9)).all())
        else:
            stored[name] = deq = t
        expected[names.canonical(name)] = deq
    save_file(stored, str(path / "model.safetensors"))
    rewrite_config(
        path,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "expert_dtype": "fp4",
        },
    )
    assert json.loads((path / "config.json").read_text())["quantization_config"]
    model = load_model(path)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    inter = model.config.moe_intermediate_size
    checked = 0
    for name, want in expected.items():
        got: Any
        if ".mlp.experts." in name:
            layer, expert, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            prefix = f"model.layers.{layer}.mlp.experts."
            if proj == "down_proj":
                got = params[prefix + "w2"][expert]
            else:
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                got = params[prefix + "w13"][expert, rows]
        else:
            got = params[name]
        assert torch.equal(got.to(want.dtype), want), name
        checked += 1
    assert checked == len(expected)
    quantized = prompt_logits(model, IDS)
    assert 1e-4 < rel_err(quantized, prompt_logits(load_model("v4-tiny"), IDS)) < 0.3
