"""What structured outputs cost: decode throughput with and without a grammar, side by side, and
the grammar compile time at a small and a DeepSeek-size vocabulary.

Throughput: B requests of the same prompts decode exactly N tokens each, free (greedy,
ignore_eos, max_tokens N + 1) or under the regex ``[a-z ]{N}`` (N tokens, then the grammar's
EOS: N + 1 tokens too), in alternating rounds so that both see the same machine. Compile: a JSON
Schema against the preset's vocabulary (384 ids) and against a synthetic 129,280-token one
(DeepSeek-V3's size; random 1-8 byte pieces, since no real vocabulary can be downloaded here),
cold (first compile) and again (xgrammar's cache).

    python loadtest/bench_structured.py                  # ~15 s here
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from harness import record, write_result

from ferry.services.common.sampling_params import StructuredOutput
from ferry.services.engine import Engine, EngineConfig, SamplingParams

SCHEMA = json.dumps(
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "tags"],
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        },
    }
)


def decode_round(engine: Engine, prompts: list[list[int]], n: int, structured: bool) -> float:
    spec = StructuredOutput("regex", f"[a-z ]{{{n}}}") if structured else None
    params = SamplingParams(
        temperature=0, max_tokens=n + 1, ignore_eos=not structured, structured_output=spec
    )
    started = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - started
    assert all(len(o.token_ids) == n + 1 for o in outs), [len(o.token_ids) for o in outs]
    return len(prompts) * (n + 1) / seconds


def compile_ms(vocab: list[bytes], eos: int) -> dict[str, float]:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    ready = time.perf_counter()
    compiler.compile_json_schema(SCHEMA, any_whitespace=False)
    first = time.perf_counter()
    compiler.compile_json_schema(SCHEMA, any_whitespace=False)
    again = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(SCHEMA, any_whitespace=False))
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    fills = []
    for ch in b'{"name":"':  # the mask at successive places of a JSON object
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fills.append(time.perf_counter() - t)
        matcher.accept_token(ch)
    return {
        "vocab": len(vocab),
        "compiler_ms": (ready - started) * 1e3,
        "first_compile_ms": (first - ready) * 1e3,
        "cached_compile_ms": (again - first) * 1e3,
        "mask_fill_ms_median": sorted(fills)[len(fills) // 2] * 1e3,
    }


def synthetic_vocab(size: int, seed: int) -> list[bytes]:
    """The 256 bytes, then random 1-8 byte pieces of lowercase text and punctuation."""
    gen = torch.Generator().manual_seed(seed)
    alphabet = b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;\"'{}[]-_"
    vocab, seen = [bytes((i,)) for i in range(256)], set()
    while len(vocab) < size - 2:
        n = int(torch.randint(2, 9, (1,), generator=gen))
        idx = torch.randint(0, len(alphabet), (n,), generator=gen).tolist()
        piece = bytes(alphabet[i] for i in idx)
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return [*vocab, b"", b""]  # two specials; the last is EOS


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="loadtest/results/structured.json")
    args = ap.parse_args()
    header = record(threads=torch.get_num_threads())

    engine = Engine(EngineConfig(model=args.model, block_size=16))
    prompts = [engine.tokenizer.encode(f"Request {i}: write something.") for i in range(args.batch)]
    decode_round(engine, prompts, 8, True)  # warm-up: imports xgrammar, builds the compiler
    free, constrained = [], []
    for _ in range(args.rounds):
        free.append(decode_round(engine, prompts, args.tokens, False))
        constrained.append(decode_round(engine, prompts, args.tokens, True))
    med = sorted(free)[len(free) // 2], sorted(constrained)[len(constrained) // 2]
    eos = engine.eos_token_ids[0]
    small = compile_ms([bytes((i,)) if i < 256 else b"" for i in range(384)], eos)
    large = compile_ms(synthetic_vocab(129_280, 0), 129_279)
    result = {
        **header,
        "decode": {
            "model": args.model,
            "batch": args.batch,
            "tokens_per_request": args.tokens + 1,
            "free_tokens_per_s": free,
            "regex_tokens_per_s": constrained,
            "median_ratio_regex_to_free": med[1] / med[0],
        },
        "compile": {"preset_vocab": small, "synthetic_deepseek_size_vocab": large},
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
