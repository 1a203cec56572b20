"""Engine: requests in, tokens out, one step at a time.

A step plans which requests run (``StepPlanner``), runs one model forward over their new tokens
on the paged latent cache, samples a token for every request whose tokens are all computed, and
updates each request's text and finish state. The engine is single-threaded and synchronous;
``AsyncEngine`` drives it from a background thread for services.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ferry.services.common.sampling_params import SamplingParams
from ferry.services.common.tokenizer import NoTokenizer, Tokenizer, load_tokenizer
from ferry.services.engine.config import EngineConfig
from ferry.services.engine.decode_graphs import DecodeGraphs
from ferry.services.engine.expert_load import ExpertLoad
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.expert_rebalance import Rebalancer
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.engine.model import ForwardBatch, MoECausalLM, load_model
from ferry.services.engine.output_processor import OutputProcessor, make_output
from ferry.services.engine.piece_graphs import compile_pieces
from ferry.services.engine.request import ImportedKv, Request, RequestOutput, Resumed, Status
from ferry.services.engine.sampler import Sampler, token_logprobs
from ferry.services.engine.step_planner import StepPlan, StepPlanner
from ferry.services.engine.structured import Grammars

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

SNAPSHOT_STEPS = 16  # a DEP rank snapshots its expert rows every this many group steps
# prompt rows whose logits over the whole vocabulary are held at once (256 x DeepSeek-V3's 129k
# in float32: 132 MB; a step's whole token budget would be gigabytes)
PROMPT_LOGPROB_ROWS = 256
# a model with state (DeepSeek-V4) keeps a prefix-cache snapshot of it every this many blocks,
# besides the prompt's last block boundary: 512 tokens at V4's 64-token blocks
SNAPSHOT_EVERY_BLOCKS = 8


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
        dtype: torch.dtype = getattr(torch, config.dtype)
        self.model = load_model(config.model, dtype, config.device, placement)
        if config.router_skew:
            self.model.skew_routing(config.router_skew)
        self.ep_group = ep_group
        self.rebalancer: Rebalancer | None = None  # applies EPLB's placement orders
        self.group_steps = 0  # lockstep steps of the DEP group, idle ones included
        self.placement_step = 0  # the group step at which the current placement took effect
        self.group_busy = False  # whether any rank of the DEP group had work in the last step
        if ep_group is not None:
            self.model.attach_ep_group(ep_group)
            self.rebalancer = Rebalancer(self.model, ep_group)
        mc = self.model.config
        self.expert_load = ExpertLoad(mc.num_moe_layers, mc.n_routed_experts)
        self.model.attach_expert_load(self.expert_load)
        self.tokenizer: Tokenizer = load_tokenizer(config.model, mc.vocab_size)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        spec = self.model.cache_spec()
        self.block_size = spec.block_size(config.block_size)
        # a state slot per sequence that may run (admission never waits for one), and as many
        # snapshots of them for the prefix cache
        num_slots = config.max_num_seqs if spec.rings else 0
        num_snapshots = num_slots if config.enable_prefix_caching else 0
        itemsize = dtype.itemsize
        num_blocks = config.num_blocks_for(
            spec.bytes_per_block(self.block_size, itemsize),
            num_slots * spec.bytes_per_state_slot(itemsize)
            + num_snapshots * spec.bytes_per_snapshot(itemsize),
        )
        self.kv_cache = self.model.allocate_kv_cache(
            num_blocks, self.block_size, num_slots, num_snapshots
        )
        self.model_fingerprint = _fingerprint(config, self.model, self.block_size)
        self.kv = KVCacheManager(
            num_blocks,
            self.block_size,
            config.enable_prefix_caching,
            self.model_fingerprint.encode(),
            num_slots,
            num_snapshots,
            spec.state_blocks(self.block_size, itemsize),
        )
        self.planner = StepPlanner(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.torch_threads = torch.get_num_threads()  # a step's (see _set_step_threads)
        self.graphs: DecodeGraphs | None = None
        # DEP ranks exchange tokens inside their MoE layers: a graph cannot hold that. On CUDA
        # the same graphs would be captured as CUDA graphs; only the CPU build exists so far.
        if (
            not config.enforce_eager
            and config.decode_graphs
            and self.model.has_decode_graph
            and ep_group is None
            and self.model.device.type == "cpu"
        ):
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.block_size,
                self.max_model_len,
                min(config.max_graph_batch, config.max_num_seqs),
                log,
            )
        # what runs eagerly runs V4's hyper-connection mixing and small batches' routed experts
        # as fused kernels (piece_graphs.py): the steps the decode graphs do not take
        if not config.enforce_eager and self.model.device.type == "cpu":
            compile_pieces(self.model, min(config.max_graph_batch, config.max_num_seqs), log)
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
        started = time.perf_counter()
        plan = self.planner.plan()
        self.num_preemptions += len(plan.preempted)
        if self.ep_group is not None:  # lockstep: every rank steps when any rank has work
            assert self.rebalancer is not None
            work, agreed = self.ep_group.agree(bool(plan), self.rebalancer.offered)
            self.group_busy = work
            version = self.rebalancer.version
            self.rebalancer.advance(agreed)  # moves experts, on every rank at the same step
            self.group_steps += 1  # the same count on every rank of the group
            if self.rebalancer.version != version:
                self.placement_step = self.group_steps
            if self.group_steps % SNAPSHOT_STEPS == 0:
                self.expert_load.snapshot(self.group_steps)
            if not work:
                return []
            if not plan:  # this rank is idle: it still takes part in every MoE exchange
                self.model.idle_moe_pass()
                return []
        if not plan:
            return []
        logits, sampling, forward_s = self._forward(plan)
        outputs: list[RequestOutput] = []
        if sampling:
            result = self.sampler(logits, sampling)
            for req, token, lp in zip(sampling, result.token_ids, result.logprobs, strict=True):
                delta = self.outputs.append(req, token, lp)
                hold = None
                if req.hand_off and req.finish_reason is None:
                    hold = self.hand_off_key(req.request_id)
                    if req.state_block_ids:  # the decode worker continues from this state
                        assert req.state_slot is not None
                        self.kv_cache.save_state(req.state_slot, req.state_block_ids)
                    self.kv.hold(hold, req.block_ids + req.state_block_ids)
                outputs.append(make_output(req, [token], delta, hold))
                if req.finish_reason is not None or hold is not None:
                    self._finish(req)
        total = time.perf_counter() - started
        self.expert_load.end_step()
        self.last_step = StepStats(len(plan.requests), plan.total_tokens, total, forward_s)
        return outputs

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request], float]:
        """Run the model on the plan's new tokens; return logits of the requests that sample
        and the seconds spent in the model."""
        input_ids: list[int] = []
        rows: list[int] = []
        sampling: list[Request] = []
        prompt_rows: list[tuple[int, Request, int]] = []  # (row, request, the next prompt token)
        for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            offset = len(input_ids)
            input_ids.extend(req.token_slice(start, start + n))
            if start + n == req.num_tokens:
                rows.append(len(input_ids) - 1)
                sampling.append(req)
            for pos in _prompt_logprob_positions(req, start, n):
                prompt_rows.append((offset + pos - start, req, req.prompt_token_ids[pos + 1]))
        snapshots = self._take_snapshots(plan)
        graph = not prompt_rows and self._graph_step(plan, len(sampling))
        self._set_step_threads(len(input_ids), graph)
        if graph:
            t0 = time.perf_counter()
            logits = self._forward_graph(plan, input_ids, snapshots)
            forward_s = time.perf_counter() - t0
            self._commit(plan, snapshots)
            return logits, sampling, forward_s
        device = self.model.device
        batch = ForwardBatch.build(
            plan.num_new_tokens,
            [r.num_computed_tokens for r in plan.requests],
            [r.block_ids for r in plan.requests],
            self.block_size,
            self.model.attention_path,
            device,
            [-1 if r.state_slot is None else r.state_slot for r in plan.requests],
            snapshots,
        )
        t0 = time.perf_counter()
        ids = torch.tensor(input_ids)
        self.expert_load.add_tokens(ids)  # the hash-routed layers' load (expert_load.py)
        hidden = self.model(ids.to(device), batch, self.kv_cache)
        logits = hidden.new_empty(0)
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=device)]).cpu()
        if prompt_rows:
            self._prompt_logprobs(hidden, prompt_rows)
        forward_s = time.perf_counter() - t0
        self._commit(plan, snapshots)
        return logits, sampling, forward_s

    def _commit(self, plan: StepPlan, snapshots: list[list[tuple[int, int]]]) -> None:
        """The plan's new tokens are in the cache: count them, and keep the step's snapshots."""
        for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            self.kv.commit(req)
        for req, points in zip(plan.requests, snapshots, strict=True):
            for pos, snap in points:  # kept under the hash of the block that ends there
                index = pos // self.block_size - 1
                block_hash = req.block_hashes[index] if index < len(req.block_hashes) else None
                self.kv.keep_snapshot(block_hash, snap)

    def _graph_step(self, plan: StepPlan, sampled: int) -> bool:
        """Whether the decode graphs run this step: one token per sequence, each sampled."""
        n = len(plan.requests)
        return (
            self.graphs is not None
            and self.graphs.covers(n)
            and sampled == n
            and all(k == 1 for k in plan.num_new_tokens)
        )

    def _set_step_threads(self, num_tokens: int, graph: bool) -> None:
        """Eager steps of fewer than ``one_thread_below`` tokens run on one torch thread, the
        rest on the engine's; with ``one_thread_below`` 0 the threads are left alone."""
        below = self.config.one_thread_below
        if below:
            want = 1 if num_tokens < below and not graph else self.torch_threads
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)

    def _forward_graph(
        self, plan: StepPlan, input_ids: list[int], snapshots: list[list[tuple[int, int]]]
    ) -> torch.Tensor:
        """``_forward`` for a step the decode graphs run: the logits. A sequence's state is
        snapshotted after the graph (its one token is the last the step adds)."""
        assert self.graphs is not None
        positions = [r.num_computed_tokens for r in plan.requests]
        tables = [r.block_ids for r in plan.requests]
        slots = [0 if r.state_slot is None else r.state_slot for r in plan.requests]
        if self.expert_load.hash_tables:  # their load counts from the tokens
            self.expert_load.add_tokens(torch.tensor(input_ids))
        counts = self.expert_load.counts_buffer(self.model.device)
        logits = self.graphs.run(input_ids, positions, tables, counts, slots)
        for req, points in zip(plan.requests, snapshots, strict=True):
            for _, snap in points:
                assert req.state_slot is not None
                self.kv_cache.save(req.state_slot, snap)
        return logits

    def _take_snapshots(self, plan: StepPlan) -> list[list[tuple[int, int]]]:
        """For a model with state: restore the state of this step's prefix hits, then choose
        where each sequence's state is snapshotted this step (position, snapshot id)."""
        if not self.kv.num_state_slots:
            return [[] for _ in plan.requests]
        for req in plan.requests:
            if req.restore_snapshot is not None:
                assert req.state_slot is not None
                self.kv_cache.restore(req.restore_snapshot, req.state_slot)
                req.restore_snapshot = None
        out: list[list[tuple[int, int]]] = []
        for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
            points = []
            for pos in self._snapshot_positions(req, n):
                snap = self.kv.take_snapshot()
                if snap is None:
                    break
                points.append((pos, snap))
            out.append(points)
        return out

    def _snapshot_positions(self, req: Request, n: int) -> list[int]:
        """Block boundaries this step crosses where the prefix cache keeps the state: the last
        one before the prompt's last token (a hit for the same prompt, or one that extends it:
        the next turn of a chat) and every SNAPSHOT_EVERY_BLOCKS blocks (shared system
        prompts)."""
        bs, done = self.block_size, req.num_computed_tokens
        prompt_end = (len(req.prompt_token_ids) - 1) // bs * bs
        first = done // bs + 1
        return [
            b * bs
            for b in range(first, (done + n) // bs + 1)
            if b * bs == prompt_end or b % SNAPSHOT_EVERY_BLOCKS == 0
        ]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt_rows: list[tuple[int, Request, int]]
    ) -> None:
        """Append each row's next prompt token's logprob (and the top n) to its request, in
        slices of PROMPT_LOGPROB_ROWS rows."""
        for at in range(0, len(prompt_rows), PROMPT_LOGPROB_ROWS):
            part = prompt_rows[at : at + PROMPT_LOGPROB_ROWS]
            index = torch.tensor([row for row, _, _ in part], device=hidden.device)
            logits = self.model.compute_logits(hidden[index]).cpu()
            targets = torch.tensor([token for _, _, token in part])
            wanted = [req.params.prompt_logprobs for _, req, _ in part]
            entries = token_logprobs(logits, targets, wanted)
            for (_, req, _), entry in zip(part, entries, strict=True):
                assert req.prompt_logprobs is not None and entry is not None
                req.prompt_logprobs.append(entry)

    def _finish(self, req: Request) -> None:
        self.planner.remove(req)
        req.status = Status.FINISHED
        del self.requests[req.request_id]

    # ---- offline use ----------------------------------------------------------------------
    def work_anywhere(self, local: bool) -> bool:
        """``local``, or on a DEP rank: whether any rank of the group has work (a collective
        every rank must call)."""
        return local if self.ep_group is None else self.ep_group.any(local)

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


def _fingerprint(config: EngineConfig, model: MoECausalLM, block_size: int) -> str:
    """Names the model and cache layout: blocks hashed under one fingerprint are reusable only
    by an engine with the same one."""
    skew = {"router_skew": config.router_skew} if config.router_skew else {}
    desc = json.dumps(
        {
            "model": config.model,
            "dtype": config.dtype,
            "block_size": block_size,
            **skew,
            "config": model.config.to_hf_dict(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


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


def _prompt_logprob_positions(req: Request, start: int, n: int) -> range:
    """The positions among this step's ``start .. start + n`` whose logits give a prompt token's
    logprob that ``req`` still lacks (position i predicts prompt token i + 1; after a
    preemption the recomputed positions already have theirs)."""
    if req.prompt_logprobs is None:
        return range(0)
    return range(
        max(start, len(req.prompt_logprobs)), min(start + n, len(req.prompt_token_ids) - 1)
    )
