"""Engine: requests in, tokens out, one step at a time.

A step schedules (``StepPlanner`` picks which requests run; a DEP rank joins its group's step,
``Lockstep``), runs the model over their new tokens (``ModelRunner``), and postprocesses: samples
a token for every request whose tokens are all computed and updates each request's text and
finish state. The engine is single-threaded and synchronous; ``AsyncEngine`` drives it from a
background thread for services.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.common.tokenizer import NoTokenizer, Tokenizer, load_tokenizer
from ferry.services.engine.config import EngineConfig
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.expert_rebalance import Rebalancer
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model_runner import Lockstep, ModelRunner
from ferry.services.engine.output_processor import OutputProcessor, make_output
from ferry.services.engine.request import ImportedKv, Request, RequestOutput, Resumed, Status
from ferry.services.engine.sampler import Sampler
from ferry.services.engine.step_planner import StepPlanner
from ferry.services.engine.structured import Grammars

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


@dataclass(frozen=True)
class StepStats:
    """Timing of the last step: the whole step and the model forward (logits included)."""

    num_seqs: int
    num_tokens: int
    total_s: float
    forward_s: float


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot for load reports: queued_prefill_tokens counts prompt tokens not yet computed."""

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0  # free plus cached (evictable)
    total_kv_blocks: int = 0
    cached_kv_blocks: int = 0
    step_time_s: float = 0.0
    step_tokens: int = 0  # tokens the last step computed
    num_preemptions: int = 0  # since the engine started
    free_state_slots: int = 0
    total_state_slots: int = 0


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        placement: ExpertPlacement | None = None,
        ep_group: EPGroup | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """``placement`` and ``ep_group`` make this engine one rank of a DEP group: it holds
        only its expert slots, and every step runs in lockstep with the other ranks. ``log``
        hears the start-up's progress (compiling the decode graphs)."""
        self.config = config = config or EngineConfig()
        self.runner = runner = ModelRunner(config, placement, ep_group, log)
        # the runner's, as the request side, the workers and the tests read them
        self.model, self.kv_cache, self.kv = runner.model, runner.kv_cache, runner.kv
        self.expert_load, self.graphs = runner.expert_load, runner.graphs
        self.block_size, self.model_fingerprint = runner.block_size, runner.model_fingerprint
        self.max_model_len = runner.max_model_len
        self.lockstep: Lockstep | None = None
        self.rebalancer: Rebalancer | None = None  # applies EPLB's placement orders
        if ep_group is not None:
            self.lockstep = Lockstep(ep_group, self.model, self.expert_load)
            self.rebalancer = self.lockstep.rebalancer
        mc = self.model.config
        self.tokenizer: Tokenizer = load_tokenizer(config.model, mc.vocab_size)
        self.planner = StepPlanner(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        eos = mc.eos_token_ids or (
            () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        )
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.sampler = Sampler(self.eos_token_ids, config.seed)
        self.outputs = OutputProcessor(self.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._generate_calls = itertools.count()
        self.num_preemptions = 0
        self.last_step: StepStats | None = None

    # ---- requests -------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Raise ValueError for a request that can never run; return its token limit."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        if isinstance(self.tokenizer, NoTokenizer):
            _refuse_text(params)
        limit = self.max_model_len
        if params.max_tokens is None:
            if n >= limit:
                raise ValueError(f"the prompt has {n} tokens; the model's limit is {limit}")
            total = limit
        else:
            total = n + params.max_tokens
            if total > limit:
                raise ValueError(
                    f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                    f"the model's limit of {limit} tokens"
                )
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            raise ValueError(
                f"{total} tokens need {self.kv.blocks_needed(total)} KV blocks; the cache has "
                f"{self.kv.num_blocks} (raise num_kv_blocks or kv_cache_memory_bytes)"
            )
        return total

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        hand_off: bool = False,
        imported: ImportedKv | None = None,
        resumed: Resumed | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queue a request. ``hand_off`` (prefill role): it ends after its first token, its
        prompt's blocks held for export (see ``RequestOutput.kv_hold``). ``imported`` (decode
        role): its prompt's KV is already in this cache and its first token already sampled.
        ``resumed``: the prompt ends with tokens it generated elsewhere (see ``_resume``).
        ``grammar``: the structured output already compiled (``self.grammars.compile``, off
        this thread); else it is compiled here."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        total = self.validate(prompt_token_ids, params)
        need = self.kv.blocks_needed(len(prompt_token_ids)) + self.kv.num_state_blocks
        if hand_off and need > self.kv.num_blocks:
            raise ValueError(
                f"the prompt's KV and its state need {need} blocks to hand off; the cache has "
                f"{self.kv.num_blocks} (raise num_kv_blocks or kv_cache_memory_bytes)"
            )
        spec = params.structured_output
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_total_tokens=total,
            detokenizer=self.tokenizer.detokenizer(params.skip_special_tokens),
            prompt_logprobs=None if params.prompt_logprobs is None else [],
            hand_off=hand_off,
            matcher=None if spec is None else self.grammars.matcher(grammar or spec),
        )
        if resumed is not None:
            self._resume(req, resumed)
        if imported is not None:
            self._adopt(req, imported)
        else:
            self.planner.add(req)
        self.requests[request_id] = req

    @staticmethod
    def _resume(req: Request, resumed: Resumed) -> None:
        """Pick up the text state where the failed worker left it: the detokenizer has seen
        the generated tokens, and the text the client has not got yet (held back as a possible
        stop string's start, or cut short with the stream) is pending. So the next token's text
        joins on, and a stop string across the move is still found. Seeded draws and the
        presence / frequency penalties count those tokens as output (``Request.num_generated``),
        so they go on as if the request had not moved. The caller (the scheduler) lowered
        max_tokens and min_tokens by what was generated."""
        k, n = resumed.num_output_tokens, len(req.prompt_token_ids)
        if not 0 < k < n:
            raise ValueError(
                f"resumed.num_output_tokens is {k}; it must be 1..{n - 1} "
                f"(the prompt has {n} tokens)"
            )
        req.num_resumed = k
        generated = req.prompt_token_ids[n - k :]
        if req.matcher is not None and not all(req.matcher.accept_token(t) for t in generated):
            raise ValueError(
                "the tokens generated before the move do not fit its structured output"
            )
        text = req.detokenizer.push(generated)
        cut = min(resumed.num_emitted_chars, len(text))
        req.text, req.pending_text = text[:cut], text[cut:]

    def _adopt(self, req: Request, imported: ImportedKv) -> None:
        """Take over an imported prompt: its blocks, then its first token replayed through the
        output processor (so that text and stop state match the prefill side's; the text itself
        was already streamed from there)."""
        state = self.kv.adopt_hold(imported.hold_key, req, len(req.prompt_token_ids))
        if state:  # the prompt's end state, packed by the prefill worker (save_state)
            assert req.state_slot is not None
            self.kv_cache.load_state(state, req.state_slot)
            self.kv.drop_state_blocks(req)
        req.num_cached_tokens = imported.num_cached_tokens
        self.outputs.append(req, imported.first_token_id, imported.first_logprobs)
        if req.finish_reason is not None:
            self.kv.free(req)
            raise ValueError(f"request {req.request_id}: its first token already ends it")
        self.planner.add_running(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (None if unknown)."""
        req = self.requests.get(request_id)
        if req is None:
            # A hand-off that finished before the abort arrived: its blocks are still held.
            self.kv.release_hold(self.hand_off_key(request_id))
            return None
        req.finish_reason = "abort"
        self._finish(req)
        return make_output(req, [], "")

    @staticmethod
    def hand_off_key(request_id: str) -> str:
        return f"hand-off:{request_id}"

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, postprocess: the outputs of the requests that got a token."""
        started = time.perf_counter()
        plan = self.planner.plan()
        self.num_preemptions += len(plan.preempted)
        if self.lockstep is not None:  # a DEP rank joins every step of its group
            self.lockstep.step(bool(plan))
        if not plan:
            return []
        logits, sampling, forward_s = self.runner.run(plan)
        outputs = self._postprocess(logits, sampling)
        total = time.perf_counter() - started
        self.expert_load.end_step()
        self.last_step = StepStats(len(plan.requests), plan.total_tokens, total, forward_s)
        return outputs

    def _postprocess(self, logits: torch.Tensor, sampling: list[Request]) -> list[RequestOutput]:
        """Sample a token for each request in ``sampling`` and turn it into text and finish
        state. A hand-off (prefill role) ends at its first token: its prompt's blocks, and the
        state the decode worker continues from, are held for export under its hand-off key."""
        outputs: list[RequestOutput] = []
        if not sampling:
            return outputs
        result = self.sampler(logits, sampling)
        for req, token, lp in zip(sampling, result.token_ids, result.logprobs, strict=True):
            delta = self.outputs.append(req, token, lp)
            hold = None
            if req.hand_off and req.finish_reason is None:
                hold = self.hand_off_key(req.request_id)
                if req.state_block_ids:
                    assert req.state_slot is not None
                    self.kv_cache.save_state(req.state_slot, req.state_block_ids)
                self.kv.hold(hold, req.block_ids + req.state_block_ids)
            outputs.append(make_output(req, [token], delta, hold))
            if req.finish_reason is not None or hold is not None:
                self._finish(req)
        return outputs

    def _finish(self, req: Request) -> None:
        self.planner.remove(req)
        req.status = Status.FINISHED
        del self.requests[req.request_id]

    # ---- offline use ----------------------------------------------------------------------
    def work_anywhere(self, local: bool) -> bool:
        """``local``, or on a DEP rank: whether any rank of the group has work (a collective
        every rank must call)."""
        return local if self.lockstep is None else self.lockstep.ep_group.any(local)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text, or token ids) to completion; outputs in prompt order."""
        plist = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(token_lists, plist, strict=True):
            self.validate(ids, p)
        base = next(self._generate_calls)
        ids_ = [f"generate-{base}-{i}" for i in range(len(prompts))]
        for rid, ids, p in zip(ids_, token_lists, plist, strict=True):
            self.add_request(rid, ids, p)
        final: dict[str, RequestOutput] = {}
        while self.work_anywhere(len(final) < len(ids_)):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids_]

    def load(self) -> EngineLoad:
        """What the engine holds now; call it on the engine's own thread."""
        waiting = self.planner.waiting
        running = self.planner.running
        queued = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        queued += sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in running)
        usage = self.kv.usage()
        last = self.last_step
        return EngineLoad(
            len(running),
            len(waiting),
            queued,
            usage["free"] + usage["cached"],
            usage["total"],
            usage["cached"],
            last.total_s if last else 0.0,
            last.num_tokens if last else 0,
            self.num_preemptions,
            len(self.kv.free_slots),
            self.kv.num_state_slots,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.requests.values())


def _refuse_text(params: SamplingParams) -> None:
    """ValueError for what a model without a tokenizer (NoTokenizer) cannot do: its outputs
    have no text to match stop strings or a grammar against."""
    if params.stop:
        raise ValueError(
            "stop strings need the model's tokenizer, and it has no tokenizer.json: "
            "stop on token ids (stop_token_ids) instead"
        )
    spec = params.structured_output
    if spec is not None:
        raise ValueError(
            f"structured output ({spec.kind}) needs the model's tokenizer, and it has no "
            "tokenizer.json"
        )
