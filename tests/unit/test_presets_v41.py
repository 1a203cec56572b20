"""The DeepSeek-V4.1 presets: their configs (every layer role, the Engram constants of the byte
tokenizer, the HF config.json round trip), and ``export_preset`` writing DeepSeek's released
layout (names and dtypes as the golden checkpoint's) that loads back to the same model."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ferry.services.common.tokenizer import ByteTokenizer, write_byte_tokenizer_json
from ferry.services.engine.model.loader import export_preset, load_checkpoint, load_preset
from ferry.services.engine.model.presets import BYTE_ENGRAM_VOCAB, PRESETS
from ferry.services.engine.model.registry import config_from_hf_dict
from ferry.services.engine.model.v41.config import V41ModelConfig
from ferry.services.engine.model.v41.engram import compressed_token_map
from ferry.services.engine.model.v41.layers import SequenceState
from ferry.services.engine.model.v41.model import DeepseekV41ForCausalLM, engram_params
from tests.v41_golden import CASES, case_dir, config_json

V41_PRESETS = ("v41-tiny", "v41-small")
# spelling variants that Engram's token normalisation merges, 40 ids with BOS
PROMPT = "Hello HÉLLO hello, Ｈｅｌｌｏ! Hi"


def config(name: str) -> V41ModelConfig:
    c = PRESETS[name].config
    assert isinstance(c, V41ModelConfig)
    return c


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_preset("v41-tiny", tmp_path_factory.mktemp("v41-tiny"))


def stored_dtypes(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118


def layout(dtypes: dict[str, str]) -> dict[str, str]:
    """Stored name without its layer and expert numbers -> dtype (one dtype each)."""
    out: dict[str, str] = {}
    for name, dtype in dtypes.items():
        key = re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"^layers\.\d+\.", "", name))
        assert out.setdefault(key, dtype) == dtype, (name, dtype, out[key])
    return out


def roles(c: V41ModelConfig) -> Counter[str]:
    """How many layers have each role (Engram and DSpark taps aside)."""
    out: Counter[str] = Counter()
    for line in c.layer_roles():
        parts = line.split(": ", 1)[1].split(", ")
        out[", ".join(p for p in parts if p not in ("Engram", "DSpark tap"))] += 1
    return out


@pytest.mark.parametrize("name", V41_PRESETS)
def test_a_preset_validates_and_has_every_layer_role(name: str) -> None:
    c = config(name)
    c.validate()
    assert roles(c) == {
        "SWA only": 2,
        "ratio 2, kv source, index source": 1,
        "ratio 2, consumer": 1,
        "ratio 1, kv source, index source, candidate source": 1,
        "ratio 1, index source, two-level top-k": 1,
        "ratio 1, consumer": 2,
    }
    # Engram on an SWA-only layer and on a ratio-2 source, as the released L1 and L14
    assert [c.ratio(i) for i in c.engram_layer_ids] == [0, 2]
    assert (c.candidate_topk_blocks - 1) * c.candidate_block_size >= c.index_topk
    assert c.vocab_size == ByteTokenizer.VOCAB_SIZE
    assert (c.fp8_block_size, c.expert_dtype) == ((32, 32), "fp4")
    assert c.num_nextn_predict_layers == len(c.dspark_target_layer_ids) == 3


def test_the_engram_constants_are_the_byte_tokenizers(tmp_path: Path) -> None:
    write_byte_tokenizer_json(tmp_path)
    token_map = compressed_token_map(tmp_path / "tokenizer.json", BYTE_ENGRAM_VOCAB)
    tok = ByteTokenizer()
    # different bytes, one compressed id each
    assert torch.equal(token_map[tok.encode("Hello", False)], token_map[tok.encode("hello", False)])
    for name in V41_PRESETS:
        c = config(name)
        assert c.engram_compressed_vocab_size == BYTE_ENGRAM_VOCAB
        params = engram_params(c)  # raises unless engram_num_embeddings are the prime sums
        assert c.engram_num_embeddings == tuple(sum(p) for p in params.primes)


@pytest.mark.parametrize("name", V41_PRESETS)
def test_a_presets_hf_config_reads_back_equal(name: str) -> None:
    c = config(name)
    d = json.loads(json.dumps(c.to_hf_dict()))
    assert config_from_hf_dict(d) == c
    assert d["architectures"] == ["DeepseekV41ForCausalLM"]
    assert (d["model_type"], d["text_config"]["model_type"]) == (
        "deepseek_v41",
        "deepseek_v41_text",
    )
    assert d["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }


@pytest.mark.parametrize("case", CASES)
def test_to_hf_dict_writes_the_golden_config_json(case: str) -> None:
    assert config_from_hf_dict(config_json(case)).to_hf_dict() == config_json(case)


def test_export_writes_deepseeks_dtypes(exported: Path) -> None:
    dtypes = stored_dtypes(exported / "model.safetensors")
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        shape = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    expect = {
        # dense: e4m3 with an E8M0 scale per 32x32 block
        "layers.2.attn.wq_a.weight": ("F8_E4M3", (64, 256)),
        "layers.2.attn.wq_a.scale": ("F8_E8M0", (2, 8)),
        # routed expert: two E2M1 codes a byte, an E8M0 scale per 32 along a row
        "layers.3.ffn.experts.5.w2.weight": ("I8", (256, 32)),
        "layers.3.ffn.experts.5.w2.scale": ("F8_E8M0", (256, 2)),
        # Engram table: e4m3 rows with an E8M0 scale per 32 of a row
        "layers.1.engram.embed.weight": ("F8_E4M3", (6126, 32)),
        "layers.1.engram.embed.scale": ("F8_E8M0", (6126, 1)),
        "layers.1.engram.q_weight": ("BF16", (4, 256)),
        "layers.2.attn.compressor.wgate.weight": ("BF16", (64, 256)),
        "layers.4.attn.indexer.wk.weight": ("BF16", (32, 64)),
        "head.weight": ("BF16", (384, 256)),
        "layers.0.attn.attn_sink": ("F32", (4,)),
        "layers.0.hc_ffn_fn": ("F32", (24, 1024)),
        "layers.0.ffn.gate.bias": ("F32", (16,)),
    }
    assert {k: (dtypes[k], shape[k]) for k in expect} == expect
    for name, dtype in dtypes.items():
        if dtype in ("F8_E4M3", "I8"):
            assert name.removesuffix(".weight") + ".scale" in dtypes, name
    assert not [k for k in dtypes if k.startswith("model.") or "self_attn" in k]
    assert (exported / "tokenizer.json").exists()


def test_export_has_the_golden_checkpoints_layout(exported: Path) -> None:
    """Every stored name (layer and expert numbers aside) has the golden checkpoint's dtype,
    the three DSpark stages (``mtp.*``) included."""
    ours = layout(stored_dtypes(exported / "model.safetensors"))
    golden = stored_dtypes(case_dir("mini-flash-fp8") / "model.safetensors")
    assert ours == layout(golden)
    assert "mtp.0.main_proj.weight" in ours and "mtp.2.markov_head.head.weight" in ours


def test_the_export_loads_as_the_preset(exported: Path) -> None:
    ids = torch.tensor(ByteTokenizer().encode(PROMPT))
    assert len(ids) == 40
    logits = []
    for model in (load_preset("v41-tiny"), load_checkpoint(exported)):
        assert isinstance(model, DeepseekV41ForCausalLM)
        assert model.config == PRESETS["v41-tiny"].config
        with torch.inference_mode():
            logits.append(model.compute_logits(model.forward_chunk(ids, SequenceState())))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)
    assert logits[0].std() > 0.1


def test_a_golden_checkpoints_dspark_stages_load_into_their_blocks() -> None:
    """``mtp.K.*`` into ``model.dspark.K``: an FP8 projection and an FP4 expert dequantised in
    place (exact in a bf16 model), the last stage's heads in float32 (the reference keeps them
    so)."""
    from ferry.services.engine.model.loader import dequantize_fp4, dequantize_fp8

    path = case_dir("compact-fp8")
    model = load_checkpoint(path, torch.bfloat16)
    params = {k: v.float() for k, v in model.named_parameters()}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        w, scale = f.get_tensor("mtp.0.main_proj.weight"), f.get_tensor("mtp.0.main_proj.scale")
        want = dequantize_fp8(w, scale, (32, 32), "main_proj", str(path))
        assert torch.equal(params["model.dspark.0.main_proj.weight"], want)
        w, scale = (f.get_tensor(f"mtp.0.ffn.experts.4.w2.{k}") for k in ("weight", "scale"))
        want = dequantize_fp4(w, scale, "w2", str(path))
        assert torch.equal(params["model.dspark.0.mlp.experts.w2"][4], want)
        head = f.get_tensor("mtp.0.markov_head.head.weight")
        assert torch.equal(params["model.dspark.0.markov_head.head.weight"], head.float())
    heads = ("markov_head.head", "confidence_head.proj")
    assert {model.get_parameter(f"model.dspark.0.{h}.weight").dtype for h in heads} == {
        torch.float32
    }
    assert model.get_parameter("model.dspark.0.main_proj.weight").dtype == torch.bfloat16
