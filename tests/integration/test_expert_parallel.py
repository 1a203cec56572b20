"""Expert parallelism over real processes: 2 and 4 ranks joined by torch.distributed (gloo on
127.0.0.1), each holding only its share of the tiny presets' expert slots (with and without
redundant replicas), give the logits of the single-process model within 1e-5 for prompts of
their own (data-parallel attention), and an idle rank with no tokens takes part in the exchange.
DEP engines (each rank its own requests, KV cache and batch, stepping in lockstep) give the
single-process engine's greedy tokens. DeepSeek-V3 (`tiny`) and DeepSeek-V4 (`v4-tiny`, whose
first two MoE layers route by token id: each rank routes its own tokens before the exchange).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ferry.infra.ports import free_port
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model import load_model, prompt_logits

NUM_EXPERTS = 16  # both presets
MOE_LAYERS = {"tiny": 3, "v4-tiny": 4}  # tiny: 4 layers, the first dense; v4-tiny: all MoE
LEARNED_LAYER = {"tiny": 1, "v4-tiny": 2}  # a layer whose router is learned
HASH_LAYER = 1  # v4-tiny's second layer routes by token id


def placement(size: int, rank: int, redundant: int, model: str = "tiny") -> ExpertPlacement:
    """Experts round-robin over the slots, plus ``redundant`` replicas of the first experts,
    shuffled per layer (seeded) so that every layer has its own map."""
    rows = []
    for layer in range(MOE_LAYERS[model]):
        gen = torch.Generator().manual_seed(100 + layer)
        logical = torch.cat([torch.arange(NUM_EXPERTS), torch.arange(redundant) * 3 % NUM_EXPERTS])
        rows.append(logical[torch.randperm(len(logical), generator=gen)])
    return ExpertPlacement(
        slot_to_logical=torch.stack(rows),
        num_logical_experts=NUM_EXPERTS,
        ep_size=size,
        ep_rank=rank,
    )


def prompts_of(rank: int) -> list[list[int]]:
    return [
        [(13 * rank + 7 * j + k) % 250 + 1 for k in range(9 + 17 * j + 5 * rank)] for j in range(3)
    ]


def _rank(rank: int, size: int, master: str, redundant: int, name: str) -> None:
    torch.set_num_threads(1)
    group = EPGroup.init(size, rank, master, timeout_s=60)
    try:
        place = placement(size, rank, redundant, name)
        model = load_model(name, placement=place)
        model.attach_ep_group(group)
        # this rank holds only its slots' weights: the other experts can only be reached by
        # sending tokens to their ranks
        learned = LEARNED_LAYER[name]
        assert model.model.layers[learned].mlp.experts.w13.shape[0] == place.slots_per_rank
        reference = load_model(name)  # one process, every expert, no exchange
        with torch.inference_mode():
            for ids in prompts_of(rank):
                got, want = prompt_logits(model, ids), prompt_logits(reference, ids)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            # rank 0 is idle in one MoE layer: it sends and receives nothing of its own
            gen = torch.Generator().manual_seed(rank)
            n = 0 if rank == 0 else 5 + rank
            x = torch.randn(n, 256, generator=gen)
            layers = [learned] + ([HASH_LAYER] if name == "v4-tiny" else [])
            for layer in layers:  # (a hash layer's experts come from the tokens' ids)
                ids = torch.randint(0, 256, (n,), generator=gen)
                out = model.model.layers[layer].mlp(x, ids)
                want = reference.model.layers[layer].mlp(x, ids)
                torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    finally:
        group.close()
    # close() really ends the group: no gloo thread or TCPStore server is left for interpreter
    # shutdown to tear down (which aborted rank 0 now and then, see EPGroup.init)
    assert not [t for t in _thread_names() if t.startswith(("gloo", "pt_gloo", "pt_tcpstore"))]


def _thread_names() -> list[str]:
    """The names of this process's live threads (one that ends while listed is left out)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
    return names


@pytest.mark.parametrize(
    ("size", "redundant", "name"),
    [(2, 0, "tiny"), (2, 2, "tiny"), (4, 0, "tiny"), (4, 4, "tiny"), (2, 2, "v4-tiny")],
)
def test_dep_ranks_match_one_process(size: int, redundant: int, name: str) -> None:
    master = f"127.0.0.1:{free_port()}"
    mp.spawn(_rank, args=(size, master, redundant, name), nprocs=size, join=True)


def _engine_rank(rank: int, size: int, master: str, redundant: int, name: str) -> None:
    from ferry.services.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(1)
    group = EPGroup.init(size, rank, master, timeout_s=60)
    try:
        config = EngineConfig(model=name, block_size=16, num_kv_blocks=128)
        engine = Engine(config, placement(size, rank, redundant, name), group)
        # 16 requests spread over the ranks; lengths differ by rank, so ranks finish at
        # different steps and then run idle MoE passes while the others still decode
        mine = [p for i, p in enumerate(all_prompts()) if i % size == rank]
        params = [
            SamplingParams(temperature=0, max_tokens=4 + 2 * i + 5 * rank, ignore_eos=True)
            for i in range(len(mine))
        ]
        got = [o.token_ids for o in engine.generate(mine, params)]
        want = [o.token_ids for o in Engine(config).generate(mine, params)]
        assert got == want
    finally:
        group.close()


def all_prompts() -> list[list[int]]:
    return [[(11 * i + 5 * k) % 250 + 1 for k in range(5 + 9 * i)] for i in range(16)]


@pytest.mark.parametrize(
    ("size", "redundant", "name"), [(2, 2, "tiny"), (4, 0, "tiny"), (2, 2, "v4-tiny")]
)
def test_dep_engines_give_single_process_greedy_outputs(
    size: int, redundant: int, name: str
) -> None:
    master = f"127.0.0.1:{free_port()}"
    mp.spawn(_engine_rank, args=(size, master, redundant, name), nprocs=size, join=True)
