"""Checkpoint loading: shards, FP8 block quantization, MTP layers, and errors that name names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferry.services.engine.model import LoaderError, load_model, prompt_logits
from ferry.services.engine.model.loader import INDEX_FILE
from tests.helpers import (
    make_hf_checkpoint,
    quantize_fp4_blocks,
    quantize_fp8_blocks,
    rel_err,
    rewrite_config,
)

IDS = list(range(0, 384, 7))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(
        tmp_path_factory.mktemp("ckpt"), seed=3, q_lora_rank=24, n_group=2, topk_group=1
    )


@pytest.fixture(scope="module")
def ref_logits(ckpt: Path) -> torch.Tensor:
    return prompt_logits(load_model(ckpt), IDS)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_sharded_checkpoint(tmp_path: Path, ref_logits: torch.Tensor) -> None:
    path = make_hf_checkpoint(
        tmp_path, seed=3, max_shard_size="100KB", q_lora_rank=24, n_group=2, topk_group=1
    )
    assert (path / INDEX_FILE).exists()
    assert len(list(path.glob("*.safetensors"))) > 3
    torch.testing.assert_close(prompt_logits(load_model(path), IDS), ref_logits, rtol=0, atol=0)


@pytest.mark.parametrize("e8m0", [False, True], ids=["scale_inv", "e8m0_scale"])
def test_fp8_block_quantized_matches_dequantized(tmp_path: Path, e8m0: bool) -> None:
    """FP8 weights with V3's float32 `_scale_inv` or V4's E8M0 `.scale`."""
    # hidden 160 and 96-wide MLPs leave partial 128x128 blocks at the edges.
    src = make_hf_checkpoint(
        tmp_path / "src", seed=5, hidden_size=160, intermediate_size=200, q_lora_rank=136
    )
    state = load_file(str(src / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.dim() == 2 and "proj" in name:  # linear layers; norms, router, embeddings stay
            q, scale = quantize_fp8_blocks(t, e8m0=e8m0)
            scale_name = name.removesuffix(".weight") + ".scale" if e8m0 else name + "_scale_inv"
            fp8[name], fp8[scale_name] = q, scale
            tiles = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
            dequant[name] = q.float() * tiles[: t.shape[0], : t.shape[1]]
        else:
            fp8[name] = dequant[name] = t
    fp8_dir, deq_dir = _copy(src, tmp_path / "fp8"), _copy(src, tmp_path / "deq")
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(dequant, str(deq_dir / "model.safetensors"))
    rewrite_config(
        fp8_dir,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    a = prompt_logits(load_model(fp8_dir), IDS)
    b = prompt_logits(load_model(deq_dir), IDS)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # and the quantization really happened: the result differs from the unquantized model
    assert rel_err(a, prompt_logits(load_model(src), IDS)) > 1e-4


def test_fp4_experts_with_e8m0_scales_match_dequantized(tmp_path: Path) -> None:
    """Routed experts in FP4 (e2m1, two a byte) with an E8M0 `.scale` per 32 values, as
    DeepSeek-V4 ships them; partial blocks at the rows' ends (hidden 80, experts 48 wide)."""
    src = make_hf_checkpoint(tmp_path / "src", seed=6, hidden_size=80, moe_intermediate_size=48)
    state = load_file(str(src / "model.safetensors"))
    fp4: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    table = torch.cat([table, -table])
    for name, t in state.items():
        if ".mlp.experts." not in name:
            fp4[name] = dequant[name] = t
            continue
        packed, scale = quantize_fp4_blocks(t)
        fp4[name], fp4[name.removesuffix(".weight") + ".scale"] = packed, scale
        codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(t.shape).long()
        dequant[name] = table[codes] * scale.float().repeat_interleave(32, 1)[:, : t.shape[1]]
        # within the format's error: half the widest step (2, between 4 and 6) of its scale
        step = scale.float().repeat_interleave(32, 1)[:, : t.shape[1]]
        assert bool(((dequant[name] - t).abs() <= step).all()), name
    assert any(".scale" in n for n in fp4)
    fp4_dir, deq_dir = _copy(src, tmp_path / "fp4"), _copy(src, tmp_path / "deq")
    save_file(fp4, str(fp4_dir / "model.safetensors"))
    save_file(dequant, str(deq_dir / "model.safetensors"))
    a = prompt_logits(load_model(fp4_dir), IDS)
    torch.testing.assert_close(a, prompt_logits(load_model(deq_dir), IDS), rtol=0, atol=1e-6)
    assert rel_err(a, prompt_logits(load_model(src), IDS)) > 1e-4


def test_mtp_layer_is_ignored(tmp_path: Path, ckpt: Path, ref_logits: torch.Tensor) -> None:
    path = _copy(ckpt, tmp_path)
    state = load_file(str(path / "model.safetensors"))
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    state[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 4)
    state[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(path / "model.safetensors"))
    rewrite_config(path, num_nextn_predict_layers=1)
    torch.testing.assert_close(prompt_logits(load_model(path), IDS), ref_logits, rtol=0, atol=0)


def _edit_state(path: Path, fn: object) -> None:
    state = load_file(str(path / "model.safetensors"))
    fn(state)  # type: ignore[operator]
    save_file(state, str(path / "model.safetensors"))


def test_shape_mismatch_names_file_and_tensor(tmp_path: Path, ckpt: Path) -> None:
    path = _copy(ckpt, tmp_path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _edit_state(path, lambda s: s.__setitem__(name, torch.zeros(5, 5)))
    with pytest.raises(
        LoaderError, match=rf"model\.safetensors: tensor '{name}' has shape \[5, 5\]"
    ):
        load_model(path)


def test_unknown_tensor(tmp_path: Path, ckpt: Path) -> None:
    path = _copy(ckpt, tmp_path)
    _edit_state(path, lambda s: s.__setitem__("model.layers.0.mlp.surprise.weight", torch.zeros(2)))
    with pytest.raises(
        LoaderError, match=re.escape("unknown tensor 'model.layers.0.mlp.surprise.weight'")
    ):
        load_model(path)


def test_missing_tensor(tmp_path: Path, ckpt: Path) -> None:
    path = _copy(ckpt, tmp_path)
    _edit_state(path, lambda s: s.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        LoaderError, match=r"missing tensor.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    ):
        load_model(path)


def test_missing_shard(tmp_path: Path) -> None:
    path = make_hf_checkpoint(tmp_path, seed=1, max_shard_size="100KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(
        LoaderError, match=f"shard '{victim.name}' listed in {INDEX_FILE} is missing"
    ):
        load_model(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"scoring_func": "softmax"}, "unsupported scoring_func 'softmax'"),
        ({"n_group": 3}, "not divisible by n_group=3"),
        ({"kv_lora_rank": None}, "missing required field 'kv_lora_rank'"),
    ],
)
def test_bad_config(tmp_path: Path, ckpt: Path, changes: dict[str, object], message: str) -> None:
    path = _copy(ckpt, tmp_path)
    rewrite_config(path, **changes)
    with pytest.raises(LoaderError, match=message) as info:
        load_model(path)
    assert "config.json" in str(info.value)


def test_unknown_source() -> None:
    with pytest.raises(LoaderError, match="neither a preset"):
        load_model("no-such-model")


def test_fp8_without_scale(tmp_path: Path, ckpt: Path) -> None:
    path = _copy(ckpt, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit_state(path, lambda s: s.__setitem__(name, s[name].to(torch.float8_e4m3fn)))
    scale = name.removesuffix(".weight") + ".scale"
    with pytest.raises(
        LoaderError, match=f"FP8 tensor '{name}' has no '{name}_scale_inv' or '{scale}'"
    ):
        load_model(path)
