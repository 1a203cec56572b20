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
