"""Engram of DeepSeek-V4.1 against the golden cases (v41-golden: DeepSeek's reference outputs):
compressed ids and row ids bit for bit, chunked and batched continuation, the config checks, and
the layer's contract (the full-model parity test checks its numbers end to end)."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

import pytest
import torch
from safetensors import safe_open

from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.v41.engram import (
    EngramHash,
    EngramLayer,
    EngramParams,
    compressed_token_map,
    dequantize_table,
)
from tests.v41_golden import CASES, PROMPTS, case_dir, goldens


def text_config(case: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((case_dir(case) / "config.json").read_text())
    return config["text_config"]


@cache
def case_hash(case: str) -> EngramHash:
    params = EngramParams.from_text_config(text_config(case))
    return EngramHash.from_tokenizer(params, case_dir(case) / "tokenizer.json")


def expand_per_32(scale: torch.Tensor) -> torch.Tensor:
    return scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)


def case_layer(case: str, layer_id: int) -> EngramLayer:
    """The Engram of ``layer_id``, its weights dequantised here by code x scale."""
    prefix = f"layers.{layer_id}.engram."
    with safe_open(case_dir(case) / "model.safetensors", "pt") as f:
        raw = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    table = raw["embed.weight"].float() * raw["embed.scale"].float().repeat_interleave(32, 1)
    wkv = raw["wkv.weight"].float()
    if "wkv.scale" in raw:  # FP8 in 32x32 blocks
        wkv = wkv * expand_per_32(raw["wkv.scale"])[: wkv.shape[0], : wkv.shape[1]]
    layer = EngramLayer(case_hash(case).params, layer_id)
    state = {"embed.weight": table, "wkv.weight": wkv}
    state |= {k: raw[k].float() for k in ("q_weight", "k_weight")}
    layer.load_state_dict(state)
    return layer


def chunks(ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(ids.split(size))


# ---- the hash -----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("case", CASES)
def test_compressed_and_row_ids_match_the_reference(case: str, prompt: int) -> None:
    hasher, golden = case_hash(case), goldens(case)
    ids = golden[f"prompt{prompt}.input_ids"]
    assert torch.equal(hasher.compress(ids), golden[f"prompt{prompt}.engram.compressed_ids"])
    assert torch.equal(hasher.row_ids(ids), golden[f"prompt{prompt}.engram.hash_ids"])


@pytest.mark.parametrize("case", CASES)
def test_the_normalisation_merges_spelling_variants(case: str) -> None:
    token_map = case_hash(case).token_map
    assert token_map.max() + 1 < len(token_map)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("case", CASES)
def test_chunks_continue_the_whole_sequence(case: str, size: int) -> None:
    hasher = case_hash(case)
    for prompt in PROMPTS:
        ids = goldens(case)[f"prompt{prompt}.input_ids"]
        lookback, pieces = hasher.start_lookback(), []
        for chunk in chunks(ids, size):
            rows, lookback = hasher.extend(lookback, chunk)
            pieces.append(rows)
        assert torch.equal(torch.cat(pieces), hasher.row_ids(ids))
        assert torch.equal(lookback, hasher.compress(ids[-hasher.params.lookback :]))


@pytest.mark.parametrize("case", CASES)
def test_a_batched_decode_step_continues_each_request(case: str) -> None:
    hasher, golden = case_hash(case), goldens(case)
    prompts = [golden[f"prompt{i}.input_ids"] for i in PROMPTS]
    prefill, end = 2, min(len(p) for p in prompts)
    lookbacks = torch.stack(
        [hasher.extend(hasher.start_lookback(), p[:prefill])[1] for p in prompts]
    )
    for pos in range(prefill, end):
        step = torch.stack([p[pos : pos + 1] for p in prompts])  # [B, 1]
        rows, lookbacks = hasher.extend(lookbacks, step)
        for i in PROMPTS:
            assert torch.equal(rows[i, 0], golden[f"prompt{i}.engram.hash_ids"][pos])


def test_history_before_the_sequence_is_the_pad() -> None:
    params = EngramParams.from_text_config(SMALL)
    hasher = EngramHash(params, torch.arange(16))
    pad = params.engram_pad_token_id
    after_pads = hasher.row_ids(torch.tensor([pad, pad, 7]))[-1]
    assert torch.equal(hasher.row_ids(torch.tensor([7]))[0], after_pads)


# ---- config checks ------------------------------------------------------------------------

SMALL: dict[str, Any] = {
    "engram_layer_ids": [0, 3],
    "engram_num_embeddings": [434, 606],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 61,
    "engram_n_heads": 3,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 16,
    "hidden_size": 96,
    "hc_mult": 4,
    "rms_norm_eps": 1e-20,
}


def test_params_from_a_text_config() -> None:
    params = EngramParams.from_text_config({**SMALL, "vocab_size": 512})
    assert params.n_layers == 2 and params.lookback == 2 and params.n_cols == 6
    assert params.primes[0] == (61, 67, 71, 73, 79, 83)  # the primes from 61 on, in order
    assert params.primes[1] == (89, 97, 101, 103, 107, 109)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"engram_num_embeddings": [434, 607]}, "engram_num_embeddings"),
        ({"engram_num_embeddings": [434]}, "engram_num_embeddings"),
        ({"engram_vocab_size": 62}, "engram_num_embeddings"),
        ({"engram_layer_ids": [3, 3]}, "engram_layer_ids"),
        ({"engram_layer_ids": []}, "engram_layer_ids"),
        ({"engram_head_dim": 48}, "engram_head_dim"),
        ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
        ({"engram_n_heads": 0}, "engram_n_heads"),
        ({"hc_mult": 0}, "hc_mult"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ],
)
def test_a_bad_config_names_its_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngramParams.from_text_config({**SMALL, **override})


def test_a_missing_field_is_named() -> None:
    config = {k: v for k, v in SMALL.items() if k != "engram_head_dim"}
    with pytest.raises(ConfigError, match="engram_head_dim"):
        EngramParams.from_text_config(config)


def test_the_map_size_must_match_the_config() -> None:
    config = text_config("compact-fp8")
    params = EngramParams.from_text_config(config)
    wrong = dataclasses.replace(params, engram_compressed_vocab_size=params.n_cols)
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size is 6"):
        EngramHash.from_tokenizer(wrong, case_dir("compact-fp8") / "tokenizer.json")
    size = config["engram_compressed_vocab_size"]
    assert len(compressed_token_map(case_dir("compact-fp8") / "tokenizer.json", size)) == 512


# ---- the layer ----------------------------------------------------------------------------


def test_table_dequantisation() -> None:
    codes = torch.randn(5, 64).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0**-3, 2.0**4]] * 5).to(torch.float8_e8m0fnu)
    table = dequantize_table(codes, scale)
    assert torch.equal(table[:, :32], codes[:, :32].float() / 8)
    assert torch.equal(table[:, 32:], codes[:, 32:].float() * 16)
    with pytest.raises(ValueError, match=r"expected \[5, 2\]"):
        dequantize_table(codes, scale[:, :1])


@pytest.mark.parametrize("case", CASES)
def test_layer_shapes_and_names(case: str) -> None:
    params = case_hash(case).params
    for slot, layer_id in enumerate(params.engram_layer_ids):
        layer = case_layer(case, layer_id)
        dim, hc = params.hidden_size, params.hc_mult
        shapes = {name: tuple(p.shape) for name, p in layer.state_dict().items()}
        assert shapes == {
            "embed.weight": (params.engram_num_embeddings[slot], params.engram_head_dim),
            "wkv.weight": ((hc + 1) * dim, params.n_cols * params.engram_head_dim),
            "q_weight": (hc, dim),
            "k_weight": (hc, dim),
        }
        ids = goldens(case)["prompt0.input_ids"]
        rows = case_hash(case).row_ids(ids)[:, layer.hash_index]
        out = layer(torch.randn(len(ids), hc, dim), rows)
        assert out.shape == (len(ids), hc, dim) and out.dtype == torch.float32


def test_a_zero_wkv_leaves_the_streams_unchanged() -> None:
    layer = case_layer("mini-flash-fp8", 4)
    with torch.no_grad():
        layer.wkv.weight.zero_()
    ids = goldens("mini-flash-fp8")["prompt1.input_ids"]
    streams = torch.randn(len(ids), 4, 128)
    assert torch.equal(layer(streams, case_hash("mini-flash-fp8").row_ids(ids)[:, 1]), streams)


@pytest.mark.parametrize("case", CASES)
def test_layer_against_the_gate_written_per_stream(case: str) -> None:
    """deepseek-v41.md §1.5 step 6, one stream at a time in float64."""
    layer_id = case_hash(case).params.engram_layer_ids[-1]
    layer = case_layer(case, layer_id)
    ids = goldens(case)["prompt2.input_ids"]
    hash_ids = case_hash(case).row_ids(ids)[:, layer.hash_index]
    torch.manual_seed(0)
    streams = torch.randn(len(ids), layer.hc, layer.dim) * torch.rand(len(ids), layer.hc, 1) * 4
    w = {name: p.double() for name, p in layer.state_dict().items()}
    kv = w["embed.weight"][hash_ids].flatten(1) @ w["wkv.weight"].T
    value, expected = kv[:, layer.hc * layer.dim :], streams.double().clone()
    for c in range(layer.hc):
        h, key = streams[:, c].double(), kv[:, c * layer.dim : (c + 1) * layer.dim]
        rms = (h.square().mean(-1) + layer.eps).sqrt() * (key.square().mean(-1) + layer.eps).sqrt()
        dot = (h * w["q_weight"][c] * w["k_weight"][c] * key).sum(-1) / rms / layer.dim**0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt())
        expected[:, c] += gate.unsqueeze(-1) * value
    torch.testing.assert_close(layer(streams, hash_ids).double(), expected, rtol=1e-5, atol=1e-5)
