"""Sampler: logits of the requests that produce a token this step -> tokens (+ logprobs).

Order of operations (vLLM's): logprobs are taken from the raw logits; then min_tokens masks the
stop tokens, logit_bias is added, penalties (repetition on prompt + output, presence / frequency
on output), a structured output's grammar masks the tokens it does not allow, temperature,
top-k, top-p, min-p; then a token is drawn. Drawing uses the exponential race
(argmax p / q, q ~ Exp(1)). A seeded request's draw for its i-th output token comes from a
generator seeded with (seed, i), not from a stream the request carries along, so it draws the same
tokens whatever else is in the batch and wherever each token is drawn: the prefill worker draws the
first, a decode worker the rest, and a request that moved (migration) draws on from its place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferry.services.engine.request import Request
from ferry.services.engine.structured import mask_logits


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SampleResult:
        """logits: [len(reqs), vocab] float32."""
        tokens = self._sample(logits, reqs)
        return SampleResult(tokens.tolist(), self._logprobs(logits, tokens, reqs))

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        structured = any(r.matcher is not None for r in reqs)
        if not structured and all(r.params.greedy and not self._needs_logit_edits(r) for r in reqs):
            return logits.argmax(dim=-1)
        logits = logits.clone()
        for row, req in enumerate(reqs):
            if self._needs_logit_edits(req):
                self._edit_logits(logits[row], req)
        if structured:
            mask_logits(logits, [r.matcher for r in reqs])
        greedy = torch.tensor([r.params.greedy for r in reqs])
        temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in reqs])
        scaled = logits / temps[:, None]
        if any(r.params.uses_top_filters for r in reqs):
            scaled = self._top_filters(scaled, reqs)
        probs = torch.softmax(scaled, dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), self._draw(probs, reqs))

    def _needs_logit_edits(self, req: Request) -> bool:
        p = req.params
        return p.uses_penalties or bool(p.logit_bias) or len(req.output_token_ids) < p.min_tokens

    def _edit_logits(self, row: torch.Tensor, req: Request) -> None:
        p = req.params
        if len(req.output_token_ids) < p.min_tokens:
            stops = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
            if stops:
                row[torch.tensor(stops)] = float("-inf")
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            row[torch.tensor(ids)] += torch.tensor(biases, dtype=row.dtype)
        vocab = row.shape[0]
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and req.num_generated:
            counts = torch.bincount(torch.tensor(req.generated_token_ids), minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    @staticmethod
    def _top_filters(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs])
        top_p = torch.tensor([r.params.top_p for r in reqs])
        min_p = torch.tensor([r.params.min_p for r in reqs])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        drop = rank >= top_k[:, None]
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the tokens before it already cover top_p (the first always stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop |= probs < min_p[:, None] * probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _draw(self, probs: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, req in enumerate(reqs):
            seed = req.params.seed
            if seed is not None and not req.params.greedy:
                place = torch.Generator().manual_seed(draw_seed(seed, req.num_generated))
                q[row].exponential_(generator=place)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, reqs: Sequence[Request]
    ) -> list[dict[int, float] | None]:
        """The sampled token's logprob plus the top-n, from the raw (unpenalised) logits."""
        return token_logprobs(logits, tokens, [r.params.logprobs for r in reqs])


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, wanted: Sequence[int | None]
) -> list[dict[int, float] | None]:
    """Per row: None where ``wanted`` is None, else ``{token: its logprob}`` followed by the
    ``wanted`` most likely tokens (the token is not repeated when it is among them)."""
    if all(n is None for n in wanted):
        return [None] * len(wanted)
    lp = torch.log_softmax(logits.float(), dim=-1)
    most = max(n or 0 for n in wanted)
    top_vals, top_ids = lp.topk(most, dim=-1) if most else (lp[:, :0], tokens[:, None][:, :0])
    chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
    out: list[dict[int, float] | None] = []
    for i, n in enumerate(wanted):
        if n is None:
            out.append(None)
            continue
        entry = {int(tokens[i]): chosen[i]}
        for t, v in zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True):
            entry.setdefault(t, v)
        out.append(entry)
    return out


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of a request's draw for output token ``index``: splitmix64 of the pair, so that
    neighbouring seeds and places give unrelated streams."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
