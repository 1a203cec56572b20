from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.services.common.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    NoTokenizer,
    Tokenizer,
    load_tokenizer,
)
from ferry.services.engine.model import export_preset

TEXT = "héllo, 世界! 🚀 ok"


def _stream(tok: Tokenizer, ids: list[int], step: int = 1) -> list[str]:
    detok = tok.detokenizer()
    pieces = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*pieces, detok.flush()]


def test_byte_roundtrip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.BOS_ID and len(ids) == 1 + len(TEXT.encode())
    assert tok.decode(ids) == TEXT
    assert tok.decode([*ids, tok.EOS_ID], skip_special_tokens=False).endswith("<|end_of_text|>")


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_never_splits_a_character(step: int) -> None:
    tok = ByteTokenizer()
    pieces = _stream(tok, tok.encode(TEXT, add_bos=False), step)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_become_replacement_chars() -> None:
    tok = ByteTokenizer()
    # a stray continuation byte, then a 4-byte character cut short at the end
    ids = [ord("a"), 0x80, ord("b"), 0xF0, 0x9F, 0x9A]
    assert "".join(_stream(tok, ids)) == "a\ufffdb\ufffd"
    assert tok.decode(ids) == "a\ufffdb\ufffd"


def test_out_of_vocab_id() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ByteTokenizer().decode([1000])


def test_exported_tokenizer_json_matches_byte_tokenizer(tmp_path: Path) -> None:
    export_preset("tiny", tmp_path)
    hf = load_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer)
    byte = ByteTokenizer()
    assert hf.encode(TEXT) == byte.encode(TEXT)
    assert (hf.bos_token_id, hf.eos_token_id) == (byte.BOS_ID, byte.EOS_ID)
    ids = hf.encode(TEXT, add_bos=False)
    pieces = _stream(hf, ids)
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)


def test_checkpoint_without_tokenizer_json(tmp_path: Path) -> None:
    """The byte-level tokenizer when the vocabulary holds it; else none (token ids only, as
    vLLM's --skip-tokenizer-init), the vocabulary and specials read from config.json."""
    assert isinstance(load_tokenizer(tmp_path, vocab_size=384), ByteTokenizer)
    config = {"vocab_size": 100, "bos_token_id": 0, "eos_token_id": [1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, NoTokenizer) and isinstance(load_tokenizer(tmp_path, 100), NoTokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (100, 0, 1)
    with pytest.raises(ValueError, match=r"no tokenizer\.json.*send the prompt as token ids"):
        tok.encode("hello")
    assert tok.decode([5, 6, 7]) == ""
    assert _stream(tok, [5, 6, 7]) == ["", "", "", ""]
