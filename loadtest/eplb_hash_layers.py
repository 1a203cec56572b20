"""DeepSeek-V4's hash-routed MoE layers under EPLB: how often to move them, and from what.

A hash layer's experts come from ``tid2eid[token id]``: its load is the token histogram through
a fixed table, nothing steers it, and it changes as slowly as the traffic's vocabulary does.
Ferry counts it from a decayed token histogram (half-life ten windows, engine/expert_load.py)
and rebalances it every ten windows (eplb_controller ``hash_every``). This simulation compares,
on V4-Flash's shapes (3 hash layers, 256 experts, 6 per token, vocabulary 129,280), over a run
of windows whose traffic mixes a slowly drifting vocabulary with a topic of its own per window:

- ``hash_class``: Ferry's rebalance of the decayed histogram every ten windows (with the
  previous placement);
- ``every_window``: Ferry's rebalance of each window's own counts, as often as the learned
  layers;
- ``published``: DeepSeek's published algorithm on the same decayed histogram at the same
  points (it has no previous placement: it places afresh).

Each placement serves the windows until the next one; balancedness is measured on the load
those windows really brought, from the first window after every strategy has placed once. Slots moved count the (layer, slot) pairs whose expert changed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from reference_eplb import rebalance_experts

from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model.full_size import DEEPSEEK_V4_FLASH
from ferry.services.eplb_controller import balancedness, rebalance, slots_changed

HASH_EVERY = 10  # windows between the hash class's rebalances (config.HASH_INTERVAL_FACTOR)
HALF_LIFE = 10  # windows (expert_load.HASH_HALF_LIFE_STEPS / the 1000-step window)
TOPIC_TOKENS, TOPIC_SHARE = 5_000, 0.2


def hash_loads(hist: np.ndarray, tables: np.ndarray, num_experts: int) -> np.ndarray:
    """[layers, experts]: each token's count added to every expert its table row names."""
    k = tables.shape[2]
    return np.stack([np.bincount(t.reshape(-1), np.repeat(hist, k), num_experts) for t in tables])


def simulate(
    seed: int, windows: int = 60, tokens_per_window: int = 256_000, num_gpus: int = 32
) -> dict[str, Any]:
    c = DEEPSEEK_V4_FLASH
    rng = np.random.default_rng(seed)
    vocab, experts, k = c.vocab_size, c.n_routed_experts, c.num_experts_per_tok
    layers = c.mlp_layer_types.count("hash_moe")
    slots = experts + num_gpus  # a redundant slot per GPU
    args = (slots, 1, 1, num_gpus)
    tables = np.stack(
        [np.stack([rng.permutation(experts)[:k] for _ in range(vocab)]) for _ in range(layers)]
    )
    # text: Zipf over a shuffled vocabulary, drifting slowly; a fifth of each window's tokens
    # come from its own topic (Zipf over 5,000 tokens of its own)
    base = rng.permutation(1.0 / np.arange(1, vocab + 1) ** 1.07)
    topic_shape = 1.0 / np.arange(1, TOPIC_TOKENS + 1)
    decay = 0.5 ** (1 / HALF_LIFE)
    hist = np.zeros(vocab)
    start = ExpertPlacement.spread(layers, experts, num_gpus, 0, num_gpus).slot_to_logical.numpy()
    placements = {"hash_class": start, "every_window": start, "published": start}
    served: dict[str, list[float]] = {name: [] for name in placements}
    moved = dict.fromkeys(placements, 0)
    same_hist: dict[str, list[float]] = {"hash_class": [], "published": []}
    for w in range(windows):
        base = base * rng.lognormal(0.0, 0.02, vocab)
        topic = np.zeros(vocab)
        topic[rng.choice(vocab, TOPIC_TOKENS, replace=False)] = topic_shape
        p = (1 - TOPIC_SHARE) * base / base.sum() + TOPIC_SHARE * topic / topic.sum()
        counts = rng.multinomial(tokens_per_window, p / p.sum()).astype(float)
        load = hash_loads(counts, tables, experts)
        if w > HASH_EVERY:  # once every strategy has placed: they serve this window
            for name, placement in placements.items():
                served[name].append(balancedness(load, placement, num_gpus))
        hist = hist * decay + counts
        new = rebalance(load, *args, previous=placements["every_window"])
        moved["every_window"] += int(new.slots_moved or 0)
        placements["every_window"] = new.phy2log
        if (w + 1) % HASH_EVERY == 0:
            smooth = hash_loads(hist, tables, experts)
            ours = rebalance(smooth, *args, previous=placements["hash_class"])
            theirs = rebalance_experts(torch.from_numpy(smooth), *args)[0].numpy()
            moved["hash_class"] += int(ours.slots_moved or 0)
            moved["published"] += slots_changed(placements["published"], theirs)
            placements["hash_class"], placements["published"] = ours.phy2log, theirs
            same_hist["hash_class"].append(balancedness(smooth, ours, num_gpus))
            same_hist["published"].append(balancedness(smooth, theirs, num_gpus))
    served_mean = {name: float(np.mean(v)) for name, v in served.items()}
    hist_mean = {name: float(np.mean(v)) for name, v in same_hist.items()}
    return {
        "model": "deepseek-v4-flash (shapes)",
        "hash_layers": layers,
        "num_experts": experts,
        "top_k": k,
        "vocab_size": vocab,
        "num_gpus": num_gpus,
        "num_slots": slots,
        "windows": windows,
        "tokens_per_window": tokens_per_window,
        "hash_every_windows": HASH_EVERY,
        "half_life_windows": HALF_LIFE,
        "balancedness_served": served_mean,
        "balancedness_on_the_histogram": hist_mean,
        "slots_moved": moved,
        "slots": layers * slots,
        "targets": {
            "hash_class_at_least_published_on_the_histogram": hist_mean["hash_class"]
            >= hist_mean["published"],
            "hash_class_fewer_moves_than_every_window": moved["hash_class"] < moved["every_window"],
        },
    }


def report(row: dict[str, Any]) -> str:
    served, hist, moved = (
        row["balancedness_served"],
        row["balancedness_on_the_histogram"],
        row["slots_moved"],
    )
    return (
        f"V4-Flash hash layers EP{row['num_gpus']}: served balancedness hash class "
        f"{served['hash_class']:.4f}, every window {served['every_window']:.4f}, published "
        f"{served['published']:.4f} | on the histogram ours {hist['hash_class']:.4f} vs "
        f"published {hist['published']:.4f} | slots moved {moved['hash_class']} vs "
        f"{moved['every_window']} (every window) vs {moved['published']} (published)"
    )
