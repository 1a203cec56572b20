"""Tokenizers: a checkpoint's ``tokenizer.json`` (HF ``tokenizers``), Ferry's byte-level one, or
none (:class:`NoTokenizer`: a checkpoint that serves token ids only).

Detokenization is incremental: :class:`IncrementalDetokenizer` turns a growing list of token ids
into text deltas and never emits half of a UTF-8 character; bytes that can never form one come
out as U+FFFD.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import tokenizers


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer: ...


class IncrementalDetokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now final."""
        ...

    def flush(self) -> str:
        """The sequence ended: return whatever is held back (incomplete bytes as U+FFFD)."""
        ...


class ByteTokenizer:
    """One token per byte (ids 0-255), then special tokens. The presets use this vocabulary."""

    BOS_ID = 256
    EOS_ID = 257
    PAD_ID = 258
    VOCAB_SIZE = 384  # 256 bytes, 3 named specials, reserved ids up to a round size
    SPECIALS: ClassVar[dict[int, str]] = {
        BOS_ID: "<|begin_of_text|>",
        EOS_ID: "<|end_of_text|>",
        PAD_ID: "<|pad|>",
    }

    vocab_size = VOCAB_SIZE
    bos_token_id: int | None = BOS_ID
    eos_token_id: int | None = EOS_ID

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS_ID, *ids] if add_bos else ids

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        if 0 <= token_id < 256:
            return bytes((token_id,))
        if not 0 <= token_id < self.VOCAB_SIZE:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (0..{self.VOCAB_SIZE - 1})"
            )
        if skip_special_tokens:
            return b""
        return self.SPECIALS.get(token_id, f"<|reserved_{token_id}|>").encode()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.token_bytes(t, skip_special_tokens) for t in token_ids)
        return data.decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return _ByteDetokenizer(self, skip_special_tokens)


class _ByteDetokenizer:
    def __init__(self, tok: ByteTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        data = b"".join(self._tok.token_bytes(t, self._skip) for t in token_ids)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A checkpoint's tokenizer.json, with BOS/EOS from tokenizer_config.json or config.json."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` itself (for libraries that read its vocabulary)."""
        return self._tok

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return _WindowDetokenizer(self, skip_special_tokens)


class _WindowDetokenizer:
    """Incremental decoding for any tokenizer (vLLM's prefix/read offsets): decode a short window
    of recent tokens with and without the new ones and emit the difference, holding it back while
    it ends in U+FFFD (a character whose bytes have not all arrived)."""

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]


class NoTokenizer:
    """A checkpoint without a tokenizer (vLLM's ``--skip-tokenizer-init``): prompts come as token
    ids, outputs are token ids with empty text, and text cannot be encoded."""

    ENCODE_ERROR = (
        "the model has no tokenizer.json, so it takes no text: send the prompt as token ids"
    )

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raise ValueError(self.ENCODE_ERROR)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return _NoDetokenizer()


class _NoDetokenizer:
    def push(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def load_tokenizer(source: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer for a preset name or a checkpoint directory.

    A checkpoint without tokenizer.json gets the byte-level tokenizer when its vocabulary
    (``vocab_size``, else config.json's) is large enough to hold it (the random checkpoints tests
    make), and none (:class:`NoTokenizer`) otherwise.
    """
    path = Path(source)
    if not path.is_dir():
        return ByteTokenizer()
    bos, eos = _special_ids(path)
    tok_file = path / "tokenizer.json"
    if tok_file.exists():
        return HFTokenizer(tok_file, bos, eos)
    vocab_size = vocab_size or _read_json(path / "config.json").get("vocab_size")
    if vocab_size is not None and vocab_size < ByteTokenizer.VOCAB_SIZE:
        return NoTokenizer(vocab_size, bos, eos)
    return ByteTokenizer()


def _read_json(f: Path) -> dict[str, Any]:
    """A JSON object from ``f``; empty when there is no such file."""
    if not f.exists():
        return {}
    d: dict[str, Any] = json.loads(f.read_text())
    return d


def _special_ids(path: Path) -> tuple[int | None, int | None]:
    for name in ("config.json", "generation_config.json"):
        d = _read_json(path / name)
        bos, eos = d.get("bos_token_id"), d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if bos is not None or eos is not None:
            return bos, eos
    return None, None


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte value (ByteLevel's alphabet)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_byte_tokenizer_json(path: Path) -> None:
    """Write ByteTokenizer as tokenizer.json (a merge-free byte-level BPE with the same ids), so
    an exported preset is a complete checkpoint for any HF tool."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    vocab = {ch: b for b, ch in enumerate(_gpt2_byte_chars())}
    tok = _Tok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [
        ByteTokenizer.SPECIALS.get(i, f"<|reserved_{i}|>")
        for i in range(256, ByteTokenizer.VOCAB_SIZE)
    ]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(path / "tokenizer.json"))
    bos, eos = (
        ByteTokenizer.SPECIALS[ByteTokenizer.BOS_ID],
        ByteTokenizer.SPECIALS[ByteTokenizer.EOS_ID],
    )
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": ByteTokenizer.SPECIALS[ByteTokenizer.PAD_ID],
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
