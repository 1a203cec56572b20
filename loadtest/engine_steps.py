"""Requests through an ``Engine`` in this process, its decode steps timed one by one: how
``profile_decode.py``, ``bench_decode_attention.py`` and ``bench_peer.py`` measure a decode step
without the services around it."""

from __future__ import annotations

import time

from ferry.services.engine import Engine, SamplingParams


def add_requests(engine: Engine, prompt: list[int], batch: int, tokens: int) -> None:
    """``batch`` requests: ``prompt``, then copies with their own last token (no prefix hit
    on it)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        tokens_i = [*prompt[:-1], prompt[-1] % 200 + 2 + i] if i else prompt
        engine.add_request(f"r{time.monotonic_ns()}-{i}", tokens_i, params)


def decode_steps(
    engine: Engine, prompt: list[int], tokens: int, batch: int = 1
) -> list[tuple[float, float]]:
    """(step seconds, forward seconds) of each decode step of ``batch`` requests."""
    add_requests(engine, prompt, batch, tokens)
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        total = time.perf_counter() - started
        stats = engine.last_step
        if stats is not None and stats.num_tokens == batch == stats.num_seqs:  # a decode step
            steps.append((total, stats.forward_s))
    return steps
