"""Turns each sampled token into request state: text, logprobs, stop checks, finish reason."""

from __future__ import annotations

from ferry.services.engine.request import Request, RequestOutput


class OutputProcessor:
    """Stop strings are matched on the detokenized text. By default what stopped a request is
    not emitted (neither a stop string nor the text of EOS or a stop token id), and text that
    could still be the start of a stop string is held back (``pending_text``) until it cannot
    be. With ``include_stop_str_in_output`` nothing is held back and the text ends with what
    stopped it (vLLM's semantics)."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids

    def append(self, req: Request, token: int, logprobs: dict[int, float] | None) -> str:
        """Record ``token``; set ``req.finish_reason`` when it ends the request. Returns the text
        this token releases."""
        p = req.params
        req.output_token_ids.append(token)
        if logprobs is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(logprobs)
        n_out = len(req.output_token_ids)
        can_stop = n_out >= p.min_tokens
        if req.matcher is not None and (
            not req.matcher.accept_token(token) or req.matcher.is_terminated()
        ):
            # the grammar is complete and this is its EOS (the mask allowed nothing else; a
            # token it refuses can only be a replayed one, and ends the request too)
            req.finish_reason = "stop"
        elif can_stop and not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = "stop"
        elif can_stop and token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        include = p.include_stop_str_in_output
        if req.finish_reason == "stop" and not include:
            return self._emit(req, req.pending_text + req.detokenizer.flush(), "")
        pending = req.pending_text + req.detokenizer.push([token])
        if p.stop and can_stop:
            # nothing is held back with include: a stop may begin in text already emitted
            longest = max(len(s) for s in p.stop)
            seen = req.text[-(longest - 1) :] if include and longest > 1 else ""
            for stop in p.stop:  # (a match ends in the new text)
                at = (seen + pending).find(stop, max(0, len(seen) - len(stop) + 1))
                if at >= 0:
                    req.finish_reason, req.stop_reason = "stop", stop
                    end = at + len(stop) - len(seen) if include else at
                    return self._emit(req, pending[:end], "")
        if req.finish_reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens)
            or req.num_tokens >= req.max_total_tokens
        ):
            req.finish_reason = "length"
        if req.finish_reason is not None:
            return self._emit(req, pending + req.detokenizer.flush(), "")
        hold = 0 if include else max((len(s) for s in p.stop), default=1) - 1
        cut = max(0, len(pending) - hold)
        return self._emit(req, pending[:cut], pending[cut:])

    @staticmethod
    def _emit(req: Request, text: str, pending: str) -> str:
        req.text += text
        req.pending_text = pending
        return text


def make_output(
    req: Request, delta_token_ids: list[int], delta_text: str, kv_hold: str | None = None
) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=req.text,
        finish_reason=req.finish_reason,
        logprobs=None if req.logprobs is None else list(req.logprobs),
        num_cached_tokens=req.num_cached_tokens,
        delta_token_ids=delta_token_ids,
        delta_text=delta_text,
        stop_reason=req.stop_reason,
        prompt_logprobs=req.prompt_logprobs,
        kv_hold=kv_hold,
        kv_block_ids=req.block_ids + req.state_block_ids if kv_hold else [],
        admitted_ns=req.admitted_ns,
    )
