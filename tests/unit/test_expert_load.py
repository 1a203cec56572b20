from __future__ import annotations

import torch

from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.expert_load import ExpertLoad


def test_window_slides_over_the_last_buckets() -> None:
    load = ExpertLoad(num_moe_layers=2, num_experts=4, window_steps=2, bucket_steps=1)
    for step in ([[0, 1]], [[1, 1]], [[3, 3]]):
        load.add(0, torch.tensor(step))
        load.add(1, torch.tensor([[2, 2]]))
        load.end_step()
    assert load.window()[0].tolist() == [0, 2, 0, 2]  # the first step has left the window
    assert load.window()[1].tolist() == [0, 0, 4, 0]
    # buckets of 2 steps in a 4-step window: the bucket being filled counts too
    load = ExpertLoad(num_moe_layers=1, num_experts=2, window_steps=4, bucket_steps=2)
    for _ in range(5):
        load.add(0, torch.tensor([[0]]))
        load.end_step()
    assert load.window().tolist() == [[5, 0]]  # two full buckets and one step of the third
    load.add(0, torch.tensor([[1]]))
    load.end_step()  # the third bucket is full: the first leaves
    assert load.window().tolist() == [[3, 1]]


def test_a_compiled_step_counts_into_the_bucket_being_filled() -> None:
    """What decode_graph adds into counts_buffer() is what add() would have counted."""
    ids = torch.randint(0, 6, (3, 5, 2), generator=torch.Generator().manual_seed(0))
    graph, each = ExpertLoad(3, 6, bucket_steps=2), ExpertLoad(3, 6, bucket_steps=2)
    for _ in range(3):  # across a bucket's end: the next step gets a fresh buffer
        flat = (ids + (torch.arange(3) * 6)[:, None, None]).reshape(-1)
        graph.counts_buffer(torch.device("cpu")).index_add_(0, flat, torch.ones_like(flat))
        graph.end_step()
        for layer in range(3):
            each.add(layer, ids[layer])
        each.end_step()
    assert torch.equal(graph.window(), each.window())
    assert graph.window().sum() == 3 * ids.numel()
    # a hash-routed layer's row counts from the tokens (DeepSeek-V4's graph leaves it at 0)
    hashed = ExpertLoad(3, 6)
    hashed.count_by_token({1: torch.tensor([[0, 1]] * 10)})
    hashed.counts_buffer(torch.device("cpu")).view(3, 6)[2, 4] += 5
    hashed.add_tokens(torch.tensor([3, 3, 7]))
    assert hashed.window().tolist() == [[0] * 6, [3, 3, 0, 0, 0, 0], [0, 0, 0, 0, 5, 0]]


def test_engine_counts_every_routed_token() -> None:
    engine = Engine(
        EngineConfig(model="tiny", block_size=16, num_kv_blocks=64, enable_prefix_caching=False)
    )
    prompts = [[5 + i] * (3 + 4 * i) for i in range(4)]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    fed = sum(len(p) + 5 - 1 for p in prompts)  # prompt tokens, then all but the last output
    top_k = engine.model.config.num_experts_per_tok
    per_layer = engine.expert_load.window().sum(dim=1).tolist()
    assert per_layer == [fed * top_k] * engine.model.config.num_moe_layers


def test_hash_layers_count_from_the_tokens_with_decay() -> None:
    """A hash-routed layer's row is the token histogram through its table (an expert a row
    names twice counts twice), decayed by half every half-life; its routing calls count
    nothing (they would count the same tokens again)."""
    load = ExpertLoad(num_moe_layers=2, num_experts=4, window_steps=4, bucket_steps=2)
    table = torch.tensor([[0, 1], [2, 2], [3, 0]])  # token 1 names expert 2 twice
    load.count_by_token({0: table}, half_life_steps=2)  # halved every bucket of 2 steps
    assert load.hash_layers == [0]
    load.add_tokens(torch.tensor([0, 1, 1, 2]))
    load.add(0, torch.tensor([[3, 3]]))  # ignored: layer 0 counts by token
    load.add(1, torch.tensor([[3, 3]]))
    assert load.window().tolist() == [[2, 1, 4, 1], [0, 0, 0, 2]]
    load.end_step()
    load.end_step()  # a bucket is full: the histogram halves, the window keeps its bucket
    assert load.window().tolist() == [[1, 0, 2, 0], [0, 0, 0, 2]]  # rounded: 1, 0.5, 2, 0.5


def test_a_v4_engine_counts_its_hash_layers_from_tokens() -> None:
    engine = Engine(EngineConfig(model="v4-tiny", enable_prefix_caching=False))
    moe = engine.model.moe_layers()
    hashed = [m.moe_layer for m in moe if m.gate.__class__.__name__ == "HashRouter"]
    assert engine.expert_load.hash_layers == hashed == [0, 1]
    prompts = [[5 + i] * (3 + 4 * i) for i in range(3)]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    fed = sum(len(p) + 4 - 1 for p in prompts)
    top_k = engine.model.config.num_experts_per_tok
    per_layer = engine.expert_load.window().sum(dim=1).tolist()
    assert per_layer == [fed * top_k] * len(moe)  # no decay yet: fewer steps than a bucket
