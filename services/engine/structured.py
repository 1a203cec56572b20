"""Structured outputs (vLLM's): a grammar that keeps every sampled token inside a JSON Schema,
any JSON object, a regular expression, a choice of strings or an EBNF grammar.

xgrammar (vLLM's default backend) compiles the grammar against the tokenizer's vocabulary once
per distinct spec (its compiler caches), and a request's ``GrammarMatcher`` follows its tokens.
Each step the sampler asks the matcher which tokens may come next and sets the others' logits
to -inf; once the grammar is complete only EOS may come.

xgrammar (and the transformers it imports) is imported at the first structured request: it
would add most of a second to every worker's start.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING

import torch

from ferry.services.common.sampling_params import StructuredOutput
from ferry.services.common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr
    from xgrammar import CompiledGrammar, GrammarMatcher

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[17:29:31] /project/cpp/x.cc:94: "


class Grammars:
    """Compiles a request's ``StructuredOutput`` for one tokenizer and model vocabulary. Safe to
    use from several threads: AsyncEngine compiles on a thread of its own, so that a new
    grammar does not stall the engine's steps (as vLLM compiles on a thread pool)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built when first needed
        self._building = threading.Lock()

    def matcher(self, spec: StructuredOutput | CompiledGrammar) -> GrammarMatcher:
        """A matcher at the start of ``spec`` (compiled here unless it already is)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(
            self.compile(spec) if isinstance(spec, StructuredOutput) else spec
        )

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """``spec`` against the vocabulary (xgrammar caches repeats); ValueError (naming what is
        wrong) when it does not compile."""
        compiler = self._compiler or self._build()
        try:
            # JSON without whitespace between tokens: a model cannot pad it forever
            if spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.spec)
            elif spec.kind == "choice":  # JSON string literals are EBNF string literals
                compiled = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in spec.choices)
                )
            else:
                compiled = compiler.compile_grammar(spec.spec)
        except RuntimeError as e:
            reason = _LOCATION.sub("", str(e).strip().splitlines()[0])
            raise ValueError(
                f"structured output ({spec.kind}) does not compile: {reason}"
            ) from None
        return compiled

    def _build(self) -> xgr.GrammarCompiler:
        with self._building:  # once, whichever thread asks first
            if self._compiler is None:
                self._compiler = self._new_compiler()
            return self._compiler

    def _new_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        tok = self._tokenizer
        if isinstance(tok, HFTokenizer):
            info = self._hf_info(tok)
        elif isinstance(tok, ByteTokenizer):  # specials decode to b"": xgrammar never allows them
            vocab = [bytes((i,)) if i < 256 else b"" for i in range(self._vocab_size)]
            info = xgr.TokenizerInfo(
                vocab, xgr.VocabType.RAW, vocab_size=self._vocab_size, stop_token_ids=self._eos
            )
        else:
            raise ValueError(f"structured output: no vocabulary for a {type(tok).__name__}")
        return xgr.GrammarCompiler(info, max_threads=1)

    def _hf_info(self, tok: HFTokenizer) -> xgr.TokenizerInfo:
        """xgrammar reads how the vocabulary encodes bytes (byte-level, byte fallback...) from the
        tokenizer, but does not see which added tokens are special in a bare tokenizer.json: it
        would let a grammar spell text with them, which the detokenizer then drops. Special
        tokens become empty strings, which xgrammar never allows (EOS is allowed as the stop)."""
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf, size = tok.hf, self._vocab_size
        detected = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=hf), vocab_size=size, stop_token_ids=self._eos
        )
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        encoded = ["" if i in special else (hf.id_to_token(i) or "") for i in range(size)]
        return xgr.TokenizerInfo(
            encoded,
            detected.vocab_type,
            vocab_size=size,
            stop_token_ids=self._eos,
            add_prefix_space=detected.add_prefix_space,
        )


def mask_logits(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
    """Set to -inf, in place, the logits of the tokens each row's matcher does not allow next
    (rows without a matcher are left alone). ``logits``: [len(matchers), vocab] float32."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_next_token_bitmask(bitmask, i)
    bitmask = bitmask.to(logits.device, non_blocking=True)  # (filled on the CPU)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
