"""Live expert rebalancing between real processes (gloo on 127.0.0.1): DEP engines that switch
to a new placement in the middle of generating keep giving the single-process engine's greedy
tokens, end up holding exactly the weights the new placement names, and report what moved.
DeepSeek-V3 (`tiny`) and DeepSeek-V4 (`v4-tiny`: its hash-routed layers are placed and moved as
the others, though nothing steers them)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ferry.infra.ports import free_port
from ferry.services.engine.expert_parallel import EPGroup
from ferry.services.engine.expert_rebalance import Move, OrderRejected, PlacementOrder, layer_moves
from ferry.services.engine.experts import ExpertPlacement

NUM_EXPERTS, REDUNDANT = 16, 2  # the tiny presets, two extra slots
MOE_LAYERS = {"tiny": 3, "v4-tiny": 4}


def shuffled(seed: int, name: str = "tiny") -> torch.Tensor:
    """A slot map per MoE layer: every expert once, two of them twice, in a seeded order."""
    rows = []
    for layer in range(MOE_LAYERS[name]):
        gen = torch.Generator().manual_seed(seed + layer)
        extra = torch.randperm(NUM_EXPERTS, generator=gen)[:REDUNDANT]
        logical = torch.cat([torch.arange(NUM_EXPERTS), extra])
        rows.append(logical[torch.randperm(len(logical), generator=gen)])
    return torch.stack(rows)


def _rank(rank: int, size: int, master: str, name: str) -> None:
    from ferry.services.engine import Engine, EngineConfig, SamplingParams
    from ferry.services.engine.model import load_model

    torch.set_num_threads(1)
    group = EPGroup.init(size, rank, master, timeout_s=60)
    try:
        config = EngineConfig(model=name, block_size=16, num_kv_blocks=128, router_skew=0.3)
        start = ExpertPlacement(shuffled(1, name), NUM_EXPERTS, size, rank)
        engine = Engine(config, start, group)
        prompts = [[(11 * i + 5 * k + rank) % 250 + 1 for k in range(5 + 9 * i)] for i in range(6)]
        params = [
            SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        target = shuffled(50, name)
        outputs: dict[str, list[int]] = {}
        assert engine.rebalancer is not None
        steps, fut = 0, None
        while engine.work_anywhere(engine.has_unfinished_requests()):
            if steps == 2 + 3 * rank:  # the ranks get the order at different steps
                fut = engine.rebalancer.submit(PlacementOrder(1, target))
            for out in engine.step():
                outputs[out.request_id] = out.token_ids
            steps += 1
        assert fut is not None and fut.done(), "the migration did not finish while serving"
        stats = fut.result()
        # the outputs are those of one process with every expert
        reference = Engine(config)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            assert outputs[f"r{i}"] == reference.generate([p], sp)[0].token_ids, f"request {i}"
        # the weights are those of a model loaded with the new placement
        now = engine.model.placement
        assert torch.equal(now.slot_to_logical, target)
        fresh = load_model(name, placement=ExpertPlacement(target, NUM_EXPERTS, size, rank))
        for got, want in zip(engine.model.model.layers, fresh.model.layers, strict=True):
            if hasattr(got.mlp, "experts"):
                assert torch.equal(got.mlp.experts.w13, want.mlp.experts.w13)
                assert torch.equal(got.mlp.experts.w2, want.mlp.experts.w2)
        changed = (shuffled(1, name) != target)[:, list(now.local_slots)].sum().item()
        assert stats.slots_moved == changed and stats.bytes_received > 0
        assert engine.rebalancer.version == 1
    finally:
        group.close()


@pytest.mark.parametrize(("size", "name"), [(2, "tiny"), (3, "tiny"), (2, "v4-tiny")])
def test_dep_engines_switch_placement_while_generating(size: int, name: str) -> None:
    master = f"127.0.0.1:{free_port()}"
    mp.spawn(_rank, args=(size, master, name), nprocs=size, join=True)


def test_layer_moves_copy_locally_when_they_can() -> None:
    # 2 ranks x 3 slots: rank 0 holds [0, 1, 2], rank 1 [3, 0, 1]
    old, new = [0, 1, 2, 3, 0, 1], [0, 2, 1, 3, 2, 3]
    moves = layer_moves(old, new, 3)
    # slot 1 and 2 swap on rank 0 (local), slot 4 needs expert 2 (rank 0 has it), slot 5
    # needs expert 3 (rank 1 has it in slot 3)
    assert moves == [Move(2, 1), Move(1, 2), Move(2, 4), Move(3, 5)]
    with pytest.raises(OrderRejected, match="expert 7"):
        layer_moves(old, [7, 1, 2, 3, 0, 1], 3)
