"""ModelRunner: a step plan in, logits out.

The runner owns the model and everything a forward needs: the KV cache's tensors (and the block
pool sized with them), the step's input tensors, the compiled decode graphs and the choice
between them and the eager forward, the torch threads a step runs on, a stateful model's prefix
snapshots, and prompt logprobs. ``Lockstep`` keeps a DEP rank's steps in step with its group's.
Neither knows about requests' text, sampling or finishing: that is the ``Engine``'s.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferry.services.engine.config import EngineConfig
from ferry.services.engine.decode_graphs import DecodeGraphs
from ferry.services.engine.expert_load import ExpertLoad
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.expert_rebalance import Rebalancer
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.kv_cache import KVCacheManager
from ferry.services.engine.model import ForwardBatch, MoECausalLM, load_model
from ferry.services.engine.piece_graphs import compile_pieces
from ferry.services.engine.request import Request
from ferry.services.engine.sampler import token_logprobs
from ferry.services.engine.step_planner import StepPlan

SNAPSHOT_STEPS = 16  # a DEP rank snapshots its expert rows every this many group steps
# prompt rows whose logits over the whole vocabulary are held at once (256 x DeepSeek-V3's 129k
# in float32: 132 MB; a step's whole token budget would be gigabytes)
PROMPT_LOGPROB_ROWS = 256
# a model with state (DeepSeek-V4) keeps a prefix-cache snapshot of it every this many blocks,
# besides the prompt's last block boundary: 512 tokens at V4's 64-token blocks
SNAPSHOT_EVERY_BLOCKS = 8

Snapshots = list[list[tuple[int, int]]]  # per request: (position, snapshot id) taken this step


@dataclass
class StepInputs:
    """A plan's new tokens laid out as one batch, and which rows of its output are read."""

    input_ids: list[int]
    sample_rows: list[int]  # the last row of each request whose tokens are then all computed
    sampling: list[Request]  # those requests, in row order
    prompt_rows: list[tuple[int, Request, int]]  # (row, request, the next prompt token)

    @classmethod
    def from_plan(cls, plan: StepPlan) -> StepInputs:
        inputs = cls([], [], [], [])
        for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            offset = len(inputs.input_ids)
            inputs.input_ids.extend(req.token_slice(start, start + n))
            if start + n == req.num_tokens:
                inputs.sample_rows.append(len(inputs.input_ids) - 1)
                inputs.sampling.append(req)
            for pos in _prompt_logprob_positions(req, start, n):
                row = offset + pos - start
                inputs.prompt_rows.append((row, req, req.prompt_token_ids[pos + 1]))
        return inputs


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        placement: ExpertPlacement | None = None,
        ep_group: EPGroup | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """Load the model (one DEP rank's share of it when ``ep_group`` is given), allocate the
        KV cache and compile what the config asks for; ``log`` hears the compiles' progress."""
        self.config = config
        dtype: torch.dtype = getattr(torch, config.dtype)
        self.model = load_model(config.model, dtype, config.device, placement)
        self.model.set_kv_cache_dtype(config.kv_cache_dtype)
        if config.router_skew:
            self.model.skew_routing(config.router_skew)
        if ep_group is not None:
            self.model.attach_ep_group(ep_group)
        mc = self.model.config
        self.expert_load = ExpertLoad(mc.num_moe_layers, mc.n_routed_experts)
        self.model.attach_expert_load(self.expert_load)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self._allocate_kv_cache(dtype)
        self.torch_threads = torch.get_num_threads()  # a step's (see _set_step_threads)
        self.graphs = self._compile(ep_group is not None, log)

    def _allocate_kv_cache(self, dtype: torch.dtype) -> None:
        """The cache's tensors and the block pool over them (``kv``), sized together from the
        config's memory budget: a state slot per sequence that may run (admission never waits
        for one), and as many snapshots of them for the prefix cache."""
        config, spec = self.config, self.model.cache_spec()
        self.block_size = spec.block_size(config.block_size)
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

    def _compile(self, dep: bool, log: Callable[[str], None] | None) -> DecodeGraphs | None:
        """The decode graphs (None where they do not apply), then the compiled pieces."""
        config = self.config
        graphs = None
        # DEP ranks exchange tokens inside their MoE layers: a graph cannot hold that. On CUDA
        # the same graphs would be captured as CUDA graphs; only the CPU build exists so far.
        if (
            not config.enforce_eager
            and config.decode_graphs
            and self.model.has_decode_graph
            and not dep
            and self.model.device.type == "cpu"
        ):
            graphs = DecodeGraphs(
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
        return graphs

    # ---- a step ---------------------------------------------------------------------------
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request], float]:
        """Run the model on the plan's new tokens and count them computed. Returns the logits
        of the requests whose tokens are now all computed (they sample), those requests, and
        the seconds spent in the model (logits included)."""
        inputs = StepInputs.from_plan(plan)
        snapshots = self._take_snapshots(plan)
        graph = not inputs.prompt_rows and self._graph_step(plan, len(inputs.sampling))
        self._set_step_threads(len(inputs.input_ids), graph)
        # forward_s times the model alone: the eager batch is built before the clock starts
        batch = None if graph else self._forward_batch(plan, snapshots)
        t0 = time.perf_counter()
        if batch is None:
            logits = self._run_graph(plan, inputs.input_ids, snapshots)
        else:
            logits = self._run_eager(batch, inputs)
        forward_s = time.perf_counter() - t0
        self._commit(plan, snapshots)
        return logits, inputs.sampling, forward_s

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

    def _forward_batch(self, plan: StepPlan, snapshots: Snapshots) -> ForwardBatch:
        """The eager forward's positions, block tables, state slots and snapshots."""
        return ForwardBatch.build(
            plan.num_new_tokens,
            [r.num_computed_tokens for r in plan.requests],
            [r.block_ids for r in plan.requests],
            self.block_size,
            self.model.attention_path,
            self.model.device,
            [-1 if r.state_slot is None else r.state_slot for r in plan.requests],
            snapshots,
        )

    def _run_eager(self, batch: ForwardBatch, inputs: StepInputs) -> torch.Tensor:
        """The model's forward, then the logits of the sampled rows and the prompt logprobs."""
        device = self.model.device
        ids = torch.tensor(inputs.input_ids)
        self.expert_load.add_tokens(ids)  # the hash-routed layers' load (expert_load.py)
        hidden = self.model(ids.to(device), batch, self.kv_cache)
        logits = hidden.new_empty(0)
        if inputs.sample_rows:
            rows = torch.tensor(inputs.sample_rows, device=device)
            logits = self.model.compute_logits(hidden[rows]).cpu()
        if inputs.prompt_rows:
            self._prompt_logprobs(hidden, inputs.prompt_rows)
        return logits

    def _run_graph(
        self, plan: StepPlan, input_ids: list[int], snapshots: Snapshots
    ) -> torch.Tensor:
        """A step the decode graphs run: the logits. A sequence's state is snapshotted after
        the graph (its one token is the last the step adds)."""
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

    def _commit(self, plan: StepPlan, snapshots: Snapshots) -> None:
        """The plan's new tokens are in the cache: count them, and keep the step's snapshots."""
        for req, n in zip(plan.requests, plan.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            self.kv.commit(req)
        for req, points in zip(plan.requests, snapshots, strict=True):
            for pos, snap in points:  # kept under the hash of the block that ends there
                index = pos // self.block_size - 1
                block_hash = req.block_hashes[index] if index < len(req.block_hashes) else None
                self.kv.keep_snapshot(block_hash, snap)

    # ---- a stateful model's prefix snapshots ----------------------------------------------
    def _take_snapshots(self, plan: StepPlan) -> Snapshots:
        """For a model with state: restore the state of this step's prefix hits, then choose
        where each sequence's state is snapshotted this step (position, snapshot id)."""
        if not self.kv.num_state_slots:
            return [[] for _ in plan.requests]
        for req in plan.requests:
            if req.restore_snapshot is not None:
                assert req.state_slot is not None
                self.kv_cache.restore(req.restore_snapshot, req.state_slot)
                req.restore_snapshot = None
        out: Snapshots = []
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

    # ---- prompt logprobs ------------------------------------------------------------------
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


class Lockstep:
    """A DEP rank's side of its group's lockstep: every rank steps when any rank has work,
    because the MoE layers exchange tokens with every rank. The collective that opens a step
    also agrees when EPLB's placement orders take effect (see expert_rebalance.py)."""

    def __init__(self, ep_group: EPGroup, model: MoECausalLM, expert_load: ExpertLoad) -> None:
        self.ep_group = ep_group
        self.model = model
        self.expert_load = expert_load
        self.rebalancer = Rebalancer(model, ep_group)  # applies EPLB's placement orders
        self.group_steps = 0  # lockstep steps of the group, idle ones included
        self.placement_step = 0  # the group step at which the current placement took effect
        self.group_busy = False  # whether any rank of the group had work in the last step

    def step(self, has_work: bool) -> None:
        """Join the group's step (``has_work``: whether this rank's plan runs anything). A rank
        with nothing to run still takes part in every MoE exchange of a busy group's step."""
        work, agreed = self.ep_group.agree(has_work, self.rebalancer.offered)
        self.group_busy = work
        version = self.rebalancer.version
        self.rebalancer.advance(agreed)  # moves experts, on every rank at the same step
        self.group_steps += 1  # the same count on every rank of the group
        if self.rebalancer.version != version:
            self.placement_step = self.group_steps
        if self.group_steps % SNAPSHOT_STEPS == 0:
            self.expert_load.snapshot(self.group_steps)
        if work and not has_work:
            self.model.idle_moe_pass()


def _fingerprint(config: EngineConfig, model: MoECausalLM, block_size: int) -> str:
    """Names the model and cache layout: blocks hashed under one fingerprint are reusable only
    by an engine with the same one."""
    skew = {"router_skew": config.router_skew} if config.router_skew else {}
    desc = json.dumps(
        {
            "model": config.model,
            "dtype": config.dtype,
            "kv_cache_dtype": config.kv_cache_dtype,
            "block_size": block_size,
            **skew,
            "config": model.config.to_hf_dict(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _prompt_logprob_positions(req: Request, start: int, n: int) -> range:
    """The positions among this step's ``start .. start + n`` whose logits give a prompt token's
    logprob that ``req`` still lacks (position i predicts prompt token i + 1; after a
    preemption the recomputed positions already have theirs)."""
    if req.prompt_logprobs is None:
        return range(0)
    return range(
        max(start, len(req.prompt_logprobs)), min(start + n, len(req.prompt_token_ids) - 1)
    )
