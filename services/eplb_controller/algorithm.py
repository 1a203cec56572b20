"""EPLB placement: which logical expert each physical slot holds, per MoE layer.

``rebalance`` follows DeepSeek's published policies (deepseek-ai/EPLB): when
``num_groups % num_nodes == 0`` (hierarchical) it packs expert groups onto nodes, replicates
experts within each node and packs each node's replicas onto its GPUs; otherwise (global) it does
the same with the whole cluster as one node. Each MoE layer is placed on its own, but every step
runs on all layers (and nodes) at once as array ops; Python loops only run over the slots of one
GPU and over rounds of local search. What differs from the published algorithm:

- replicas: the same rule (each extra replica to the expert with the highest load per replica,
  i.e. D'Hondt apportionment), solved by one sort, and capped at one replica per GPU;
- packing: replicas go onto GPUs one slot layer at a time (the k-th heaviest of a layer to the
  k-th lightest GPU); swaps then remove any GPU's second replica of an expert, and a local search
  swaps replicas between heavy and light GPUs while that lowers the heavier one;
- ``previous``: per layer, either the previous placement brought up to date (replica counts
  adjusted, a few swaps off the heaviest GPUs) when it balances within ``tolerance`` of a fresh
  one, or the fresh one with its nodes, GPUs and slots renumbered to keep what they can.

Slot ``p * S + i`` (``S = num_replicas // num_gpus``) is the i-th slot of GPU ``p``, and GPU
``p`` is on node ``p // (num_gpus // num_nodes)``: ``phy2log`` is the ``slot_to_logical`` of the
engine's ``ExpertPlacement`` with ``ep_size = num_gpus``.

The arithmetic runs in numpy on the host: a few hundred small array ops, which numpy runs
several times faster than torch on a CPU, and which would gain nothing from a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

ArrayLike = npt.ArrayLike  # numpy, nested lists, or a host tensor (torch's __array__)


@dataclass(frozen=True)
class Placement:
    """A slot map for every MoE layer, with its inverse (all int64)."""

    phy2log: np.ndarray  # [L, num_replicas]: the logical expert held by each physical slot
    log2phy: np.ndarray  # [L, E, max_replicas]: each expert's slots in increasing order, -1 padded
    logcnt: np.ndarray  # [L, E]: replicas per logical expert
    slots_moved: int | None = None  # slots whose expert changed against ``previous``, if given

    @classmethod
    def from_phy2log(
        cls, phy2log: ArrayLike, num_logical_experts: int, slots_moved: int | None = None
    ) -> Placement:
        slots = _slots(phy2log)
        num_layers, num_slots = slots.shape
        logcnt = _row_counts(slots, num_logical_experts)
        by_expert = np.argsort(slots, axis=1, kind="stable")  # [L, R] slots grouped by expert
        expert = np.take_along_axis(slots, by_expert, 1)
        first = np.cumsum(logcnt, 1) - logcnt  # [L, E] where each expert's run starts
        replica = np.arange(num_slots) - np.take_along_axis(first, expert, 1)
        log2phy = np.full((num_layers, num_logical_experts, int(logcnt.max())), -1)
        log2phy[np.arange(num_layers)[:, None], expert, replica] = by_expert
        return cls(slots, log2phy, logcnt, slots_moved)


def rebalance(
    weight: ArrayLike,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    previous: Placement | ArrayLike | None = None,
    *,
    tolerance: float = 0.002,
) -> Placement:
    """Place ``num_replicas`` slots per layer for the loads ``weight`` [L, E].

    With ``previous`` (a Placement or its phy2log), slots keep their expert where that costs at
    most ``tolerance`` balancedness in a layer, and ``slots_moved`` counts those that change.
    Raises ValueError when the sizes do not fit together.
    """
    loads = _as_loads(weight)
    layout = _Layout(loads.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    fresh = _place(loads, layout)
    if previous is None:
        return Placement.from_phy2log(fresh, layout.num_logical_experts)
    prev = _previous_slots(previous, loads.shape[0], layout)
    warm, usable = _warm_start(prev, loads, layout)
    margin = _layer_balancedness(loads, warm, num_gpus) - _layer_balancedness(
        loads, fresh, num_gpus
    )
    keep = usable & (margin >= -tolerance)  # [L]
    phy2log = warm.copy()
    if not keep.all():  # alignment only matters where the new placement wins
        phy2log[~keep] = _align(fresh[~keep], prev[~keep], layout)
    return Placement.from_phy2log(phy2log, layout.num_logical_experts, int((phy2log != prev).sum()))


def rebalance_layers(
    weight: ArrayLike,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    previous: Placement | ArrayLike,
    layers: list[int],
) -> Placement:
    """``rebalance`` of ``layers`` alone: every other layer keeps ``previous``'s slots (the
    controller moves hash-routed layers less often than learned ones)."""
    loads, prev = _as_loads(weight), _slots(previous)
    part = rebalance(loads[layers], num_replicas, num_groups, num_nodes, num_gpus, prev[layers])
    phy2log = prev.copy()
    phy2log[layers] = part.phy2log
    return Placement.from_phy2log(phy2log, loads.shape[1], part.slots_moved)


def balancedness(weight: ArrayLike, placement: Placement | ArrayLike, num_gpus: int) -> float:
    """Mean GPU load / max GPU load, averaged over layers (1.0 is perfect)."""
    return float(layer_balancedness(weight, placement, num_gpus).mean())


def layer_balancedness(
    weight: ArrayLike, placement: Placement | ArrayLike, num_gpus: int
) -> np.ndarray:
    """[L] mean GPU load / max GPU load per layer; a replicated expert's load splits evenly
    over its replicas."""
    return _layer_balancedness(_as_loads(weight), _slots(placement), num_gpus)


def slots_changed(previous: Placement | ArrayLike, new: Placement | ArrayLike) -> int:
    """How many (layer, slot) pairs hold a different logical expert in ``new``."""
    old, cur = _slots(previous), _slots(new)
    if old.shape != cur.shape:
        raise ValueError(f"placements differ in shape: {old.shape} vs {cur.shape}")
    return int((old != cur).sum())


# ---- sizes and inputs --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """The sizes of one placement problem, checked; a *domain* is what one packing spreads
    over: a node (hierarchical policy) or the whole cluster (global policy)."""

    num_logical_experts: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int

    def __post_init__(self) -> None:
        for name in ("num_logical_experts", "num_replicas", "num_groups", "num_nodes", "num_gpus"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        checks = [
            ("num_replicas", "num_gpus", "every GPU holds the same number of slots"),
            ("num_gpus", "num_nodes", "every node has the same number of GPUs"),
            ("num_logical_experts", "num_groups", "every expert group has the same size"),
        ]
        for a, b, why in checks:
            x, y = getattr(self, a), getattr(self, b)
            if x % y:
                raise ValueError(f"{a} % {b} = {x} % {y} = {x % y}, must be 0: {why}")
        if self.num_replicas < self.num_logical_experts:
            raise ValueError(
                f"num_replicas {self.num_replicas} < num_logical_experts "
                f"{self.num_logical_experts}: every logical expert needs a slot"
            )
        if self.slots_per_gpu > self.experts_per_domain:
            where = "node" if self.hierarchical else "cluster"
            raise ValueError(
                f"{self.slots_per_gpu} slots per GPU but {self.experts_per_domain} "
                f"experts per {where}: some GPU would hold two replicas of one "
                "expert"
            )

    @property
    def hierarchical(self) -> bool:
        return self.num_groups % self.num_nodes == 0

    @property
    def num_domains(self) -> int:
        return self.num_nodes if self.hierarchical else 1

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def gpus_per_domain(self) -> int:
        return self.num_gpus // self.num_domains

    @property
    def slots_per_domain(self) -> int:
        return self.num_replicas // self.num_domains

    @property
    def experts_per_domain(self) -> int:
        return self.num_logical_experts // self.num_domains


def _as_loads(weight: ArrayLike) -> np.ndarray:
    loads = np.asarray(weight, dtype=np.float64)
    if loads.ndim != 2:
        raise ValueError(f"weight must be [num_layers, num_logical_experts], got {loads.shape}")
    if not np.isfinite(loads).all() or (loads < 0).any():
        raise ValueError("weight must be finite and non-negative")
    return loads


def _slots(placement: Placement | ArrayLike) -> np.ndarray:
    """A placement's phy2log as an int64 array."""
    slots = placement.phy2log if isinstance(placement, Placement) else placement
    return np.asarray(slots, dtype=np.int64)


def _previous_slots(
    previous: Placement | ArrayLike, num_layers: int, layout: _Layout
) -> np.ndarray:
    prev = _slots(previous)
    want = (num_layers, layout.num_replicas)
    if prev.shape != want:
        raise ValueError(f"previous placement is {prev.shape}, expected {want}")
    if prev.size and (prev.min() < 0 or prev.max() >= layout.num_logical_experts):
        raise ValueError(
            f"previous placement names an expert outside 0..{layout.num_logical_experts - 1}"
        )
    return prev


def _row_counts(keys: np.ndarray, num_keys: int) -> np.ndarray:
    """[..., n] keys → [..., num_keys] how often each key occurs in each row."""
    rows = keys.reshape(-1, keys.shape[-1])
    offset = np.arange(len(rows))[:, None] * num_keys
    counts = np.bincount((rows + offset).ravel(), minlength=len(rows) * num_keys)
    return counts.reshape(*keys.shape[:-1], num_keys)


def _layer_balancedness(loads: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    counts = np.maximum(_row_counts(phy2log, loads.shape[1]), 1)
    slot_load = np.take_along_axis(loads / counts, phy2log, axis=1)  # [L, R]
    gpu_load = slot_load.reshape(len(phy2log), num_gpus, -1).sum(-1)  # [L, num_gpus]
    heaviest = gpu_load.max(1)
    return np.where(heaviest > 0, gpu_load.mean(1) / np.maximum(heaviest, 1e-300), 1.0)


# ---- a fresh placement ---------------------------------------------------------------------------


def _place(loads: np.ndarray, layout: _Layout) -> np.ndarray:
    """[L, E] loads → [L, R] phy2log, every layer and domain at once."""
    num_layers = len(loads)
    experts = _domain_experts(loads, layout)  # [L * D, E / D] logical ids of each domain
    domain_loads = np.take_along_axis(loads, experts.reshape(num_layers, -1), 1)
    domain_loads = domain_loads.reshape(experts.shape)
    counts = _replica_counts(domain_loads, layout.slots_per_domain, layout.gpus_per_domain)
    item_load, item_key = _replica_items(domain_loads, counts)  # [L * D, R / D]
    bins = _pack_layers(item_load, item_key, layout.gpus_per_domain, layout.experts_per_domain)
    _repair(bins)
    _refine(bins, pair_rounds=4)
    phy2log = np.take_along_axis(experts, bins.key.reshape(len(experts), -1), 1)
    return phy2log.reshape(num_layers, layout.num_replicas)


def _domain_experts(loads: np.ndarray, layout: _Layout) -> np.ndarray:
    """[L, E] → [L * D, E / D]: the logical experts of each domain, group by group. Groups go
    to nodes by the same greedy packing and local search as replicas go to GPUs."""
    num_layers, num_logical = loads.shape
    domains = layout.num_domains
    if domains == 1:
        return np.tile(np.arange(num_logical), (num_layers, 1))
    group_size = num_logical // layout.num_groups
    group_load = loads.reshape(num_layers, layout.num_groups, group_size).sum(-1)  # [L, groups]
    order = np.argsort(-group_load, axis=1, kind="stable")
    bins = _pack_layers(np.take_along_axis(group_load, order, 1), order, domains, layout.num_groups)
    _refine(bins, pair_rounds=4)
    experts = bins.key[..., None] * group_size + np.arange(group_size)  # [L, D, G / D, size]
    return experts.reshape(num_layers * domains, -1)


def _replica_counts(loads: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """[X, n] loads → [X, n] replicas per expert, in 1..cap, ``num_slots`` per row.

    Giving each extra replica to the expert with the highest load per replica picks, among the
    gains ``load / j`` (the j-th extra replica of an expert), the ``num_slots - n`` largest: one
    sort instead of a loop over slots. Only the ``num_slots - n`` heaviest experts can win any
    (an expert's best gain is its load), so only they are looked at. Ties go to the heavier
    expert: that leaves fewer replicas at the highest load per replica.
    """
    num_rows, num_experts = loads.shape
    extra = num_slots - num_experts
    counts = np.ones((num_rows, num_experts), dtype=np.int64)
    per_expert = min(cap - 1, extra)
    if per_expert <= 0:
        return counts
    candidates = np.argsort(-loads, axis=1, kind="stable")[:, :extra]  # [X, c] heaviest first
    gains = np.take_along_axis(loads, candidates, 1)[:, :, None] / np.arange(1, per_expert + 1)
    gains = gains.reshape(num_rows, -1)  # [X, c * per_expert]
    top = np.argsort(-gains, axis=1, kind="stable")[:, :extra]
    winners = np.take_along_axis(candidates, top // per_expert, 1)  # [X, extra]
    return counts + _row_counts(winners, num_experts)


def _replica_items(loads: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[X, n] loads and replica counts → (load, expert) of every replica [X, sum of counts],
    heaviest first; an expert's replicas stay next to each other (equal loads, stable sort)."""
    num_rows, num_experts = loads.shape
    flat = np.tile(np.arange(num_experts), num_rows)
    expert = np.repeat(flat, counts.ravel()).reshape(num_rows, -1)
    load = np.take_along_axis(loads / counts, expert, 1)
    order = np.argsort(-load, axis=1, kind="stable")
    return np.take_along_axis(load, order, 1), np.take_along_axis(expert, order, 1)


# ---- packing items into bins -------------------------------------------------------------------


@dataclass
class _Bins:
    """Items in equal-size bins, per row (a row is one layer's domain): each bin's items in
    slot order, the bins' loads, and how many items of each key (expert) a bin holds."""

    load: np.ndarray  # [X, num_bins, size] float64
    key: np.ndarray  # [X, num_bins, size] int64
    total: np.ndarray  # [X, num_bins] float64, load summed over each bin
    count: np.ndarray  # [X, num_keys, num_bins] int16: a key's bins side by side

    @classmethod
    def build(cls, load: np.ndarray, key: np.ndarray, num_keys: int) -> _Bins:
        num_rows, num_bins, _ = key.shape
        count = np.zeros((num_rows, num_keys, num_bins), dtype=np.int16)
        row, bin_ = np.indices(key.shape)[:2]
        count[row, key, bin_] = 1
        # a key twice in one bin (rare): count the second and later copies too
        later = np.sort(key, axis=2)
        dup = np.nonzero(later[..., 1:] == later[..., :-1])
        np.add.at(count, (dup[0], later[..., 1:][dup], dup[1]), 1)
        return cls(load, key, load.sum(-1), count)

    def swap(
        self, rows: np.ndarray, a: np.ndarray, i: np.ndarray, b: np.ndarray, j: np.ndarray
    ) -> None:
        """Exchange item ``i`` of bin ``a`` with item ``j`` of bin ``b``, elementwise; no two
        entries may name the same bin of the same row."""
        load_i, load_j = self.load[rows, a, i], self.load[rows, b, j]
        key_i, key_j = self.key[rows, a, i], self.key[rows, b, j]
        self.load[rows, a, i], self.load[rows, b, j] = load_j, load_i
        self.key[rows, a, i], self.key[rows, b, j] = key_j, key_i
        self.total[rows, a] += load_j - load_i
        self.total[rows, b] += load_i - load_j
        self.count[rows, key_i, a] -= 1
        self.count[rows, key_j, a] += 1
        self.count[rows, key_j, b] -= 1
        self.count[rows, key_i, b] += 1

    def holds(self, rows: np.ndarray, bins: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Whether bin ``bins`` of row ``rows`` holds key ``keys``, elementwise (broadcast)."""
        _, num_keys, num_bins = self.count.shape
        return np.take(self.count, (rows * num_keys + keys) * num_bins + bins) > 0


def _pack_layers(load: np.ndarray, key: np.ndarray, num_bins: int, num_keys: int) -> _Bins:
    """[X, n] items, heaviest first, into ``num_bins`` bins of n / num_bins items per row, one
    layer of ``num_bins`` items at a time: the k-th heaviest item of a layer goes to the k-th
    lightest bin so far. A bin can get two items of one key this way (only of a key whose items
    straddle two layers); ``_repair`` undoes that."""
    num_rows, num_items = load.shape
    size = num_items // num_bins
    layer_load = load.reshape(num_rows, size, num_bins)  # [X, layer, item]
    bin_of = np.empty((num_rows, size, num_bins), dtype=np.int64)
    total = np.zeros((num_rows, num_bins))
    r = np.arange(num_rows)[:, None]
    for layer in range(size):
        lightest_first = np.argsort(total, axis=1, kind="stable")
        bin_of[:, layer] = lightest_first
        total[r, lightest_first] += layer_load[:, layer]
    place = (r[:, :, None], bin_of, np.arange(size)[:, None])
    table_load = np.empty((num_rows, num_bins, size))
    table_key = np.empty((num_rows, num_bins, size), dtype=np.int64)
    table_load[place], table_key[place] = layer_load, key.reshape(layer_load.shape)
    return _Bins.build(table_load, table_key, num_keys)


def _best_swaps(
    bins: _Bins, rows: np.ndarray, src: np.ndarray, item_ok: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each row, the swap of an item ``i`` of bin ``src`` (one with ``item_ok`` [r, S], if
    given) with an item ``j`` of another bin ``q`` that leaves the lower maximum of the two
    bins' loads, never putting a key into a bin that holds it. → (that maximum, inf where no swap
    is allowed; i; q; j), each [r]."""
    load, key, totals = bins.load[rows], bins.key[rows], bins.total[rows]  # [r, m, S], [r, m]
    num_rows, num_bins, size = load.shape
    r = np.arange(num_rows)
    # NOTE: q == src is blocked too, since src holds its own keys
    i_in_q = bins.count[rows[:, None], key[r, src]] > 0  # [r, S(i), m]
    if item_ok is not None:
        i_in_q |= ~item_ok[:, :, None]
    j_in_src = bins.holds(rows[:, None, None], src[:, None, None], key)  # [r, m, S]
    # moving d = load_i - load_j from src to q leaves max(src - d, q + d) = mid + |d - half|
    src_total = totals[r, src][:, None]
    half, mid = (src_total - totals) / 2, (src_total + totals) / 2  # [r, m]
    partner = np.where(j_in_src, np.inf, load + half[..., None]).transpose(0, 2, 1)  # [r, S, m]
    score = np.abs(load[r, src][:, :, None, None] - partner[:, None])  # [r, S(i), S(j), m]
    score += np.where(i_in_q, np.inf, mid[:, None])[:, :, None]
    flat = score.reshape(num_rows, -1)
    swap = flat.argmin(1)
    i, j, q = np.unravel_index(swap, (size, size, num_bins))
    return flat[r, swap], i, q, j


def _repair(bins: _Bins) -> None:
    """Swap replicas out of bins that hold two of one expert; each swap removes one duplicate."""
    while True:
        duplicate = bins.count > 1  # [X, K, m]
        rows = np.flatnonzero(duplicate.any((1, 2)))
        if not len(rows):
            return
        src = duplicate[rows].any(1).argmax(1)
        item_ok = bins.count[rows[:, None], bins.key[rows, src], src[:, None]] > 1  # [r, S]
        best, i, q, j = _best_swaps(bins, rows, src, item_ok)
        if np.isinf(best).any():
            raise RuntimeError("no swap removes a duplicate replica")  # unreachable for S <= n
        bins.swap(rows, src, i, q, j)


def _refine(
    bins: _Bins, rows: np.ndarray | None = None, pair_rounds: int = 0, max_rounds: int = 32
) -> None:
    """Local search on the heaviest bin of each row: swap one of its items with one of another
    bin while that leaves both below its load. The first ``pair_rounds`` rounds also make the
    same kind of swap in disjoint (heavy, light) pairs of bins first, which settles rows in
    fewer rounds but moves more items. A row drops out once its heaviest bin cannot be helped.
    """
    rows = np.arange(len(bins.load)) if rows is None else rows
    for round_ in range(max_rounds):
        if not len(rows):
            return
        if round_ < pair_rounds:
            _swap_pairs(bins, rows)
        rows = rows[_swap_heaviest(bins, rows)]


def _swap_heaviest(bins: _Bins, rows: np.ndarray) -> np.ndarray:
    """Make the best swap with the heaviest bin of each row where it lowers that bin's load
    and keeps the other below it. → [r] whether the row changed."""
    if not len(rows):
        return np.zeros(0, dtype=bool)
    src = bins.total[rows].argmax(1)
    best, i, q, j = _best_swaps(bins, rows, src)
    better = best < bins.total[rows, src] * (1 - 1e-12)
    bins.swap(rows[better], src[better], i[better], q[better], j[better])
    return better


def _swap_pairs(bins: _Bins, rows: np.ndarray) -> None:
    """Pair the k-th heaviest bin with the k-th lightest in each row and make, in every pair,
    the swap that leaves the lower maximum, where that is below the heavy bin's load."""
    totals = bins.total[rows]  # [r, m]
    num_rows, num_bins = totals.shape
    size = bins.load.shape[2]
    order = np.argsort(totals, axis=1)
    heavy, light = order[:, ::-1][:, : num_bins // 2], order[:, : num_bins // 2]  # [r, pairs]
    g, r = rows[:, None], np.arange(num_rows)[:, None]
    heavy_total, light_total = totals[r, heavy], totals[r, light]
    i_in_light = bins.holds(g[..., None], light[..., None], bins.key[g, heavy])  # [r, p, S]
    j_in_heavy = bins.holds(g[..., None], heavy[..., None], bins.key[g, light])
    half, mid = (heavy_total - light_total) / 2, (heavy_total + light_total) / 2  # [r, p]
    partner = np.where(j_in_heavy, np.inf, bins.load[g, light] + half[..., None])  # [r, p, S]
    score = np.abs(bins.load[g, heavy][..., :, None] - partner[..., None, :])  # as in _best_swaps
    score += np.where(i_in_light, np.inf, mid[..., None])[..., None]  # [r, p, S(i), S(j)]
    flat = score.reshape(num_rows, num_bins // 2, -1)
    swap = flat.argmin(-1)  # [r, pairs]
    best = np.take_along_axis(flat, swap[..., None], -1)[..., 0]
    row, pair = np.nonzero(best < heavy_total * (1 - 1e-12))
    i, j = np.divmod(swap[row, pair], size)
    bins.swap(rows[row], heavy[row, pair], i, light[row, pair], j)


# ---- staying close to the previous placement -------------------------------------------------


def _align(fresh: np.ndarray, prev: np.ndarray, layout: _Layout) -> np.ndarray:
    """Renumber the nodes and GPUs of ``fresh`` [L, R] and order each GPU's slots so that most
    slots hold what they hold in ``prev``; GPU loads only trade places, balance is unchanged."""
    num_layers, num_slots = fresh.shape
    domains, gpus, per_gpu = layout.num_domains, layout.gpus_per_domain, layout.slots_per_gpu
    if domains > 1:
        by_node = (num_layers, domains, -1)
        fresh = _match_units(
            fresh.reshape(by_node), prev.reshape(by_node), layout.num_logical_experts
        )
    by_gpu = (num_layers * domains, gpus, per_gpu)
    fresh = _match_units(fresh.reshape(by_gpu), prev.reshape(by_gpu), layout.num_logical_experts)
    fresh = _keep_slots(fresh.reshape(-1, per_gpu), prev.reshape(-1, per_gpu))
    return fresh.reshape(num_layers, num_slots)


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """[X, n] → [X, n]: how many earlier entries of the row hold the same key."""
    n = keys.shape[1]
    earlier = np.tri(n, k=-1, dtype=bool)
    return ((keys[:, :, None] == keys[:, None, :]) & earlier).sum(-1)


def _match_units(new: np.ndarray, old: np.ndarray, num_keys: int) -> np.ndarray:
    """[X, U, n] slot maps of U units (nodes or GPUs) → ``new`` with its units reordered so that
    each sits where an old unit with much the same experts was."""
    target = _match(_overlap(new, old, num_keys))  # [X, U] old unit of each new unit
    out = np.empty_like(new)
    np.put_along_axis(out, np.broadcast_to(target[:, :, None], new.shape), new, 1)
    return out


def _overlap(new: np.ndarray, old: np.ndarray, num_keys: int) -> np.ndarray:
    """[X, U, n] → [X, U_new, U_old] int16: how many distinct keys two units share, counted
    from the (few) old units that hold each key of a new unit, not by comparing all pairs."""
    num_rows, units, n = new.shape
    holders = _holders(old, num_keys)  # [X, K, W]
    first = _occurrence(new.reshape(-1, n)).reshape(new.shape) == 0
    shared = holders[np.arange(num_rows)[:, None, None], new]  # [X, U, n, W]
    pair = np.arange(num_rows * units).reshape(num_rows, units, 1, 1) * units + shared
    pair = pair[(shared >= 0) & first[..., None]]
    overlap = np.bincount(pair, minlength=num_rows * units * units)
    return overlap.astype(np.int16).reshape(num_rows, units, units)


def _holders(units: np.ndarray, num_keys: int) -> np.ndarray:
    """[X, U, n] slot maps → [X, K, W]: the units that hold each key, -1 padded."""
    num_rows, _, n = units.shape
    first = _occurrence(units.reshape(-1, n)).reshape(units.shape) == 0
    row, unit, slot = np.nonzero(first)
    key = units[row, unit, slot]
    order = np.lexsort((unit, key, row))
    row, unit, key = row[order], unit[order], key[order]
    group = row * num_keys + key
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    rank = np.arange(len(group)) - np.repeat(starts, np.diff(np.r_[starts, len(group)]))
    table = np.full((num_rows, num_keys, int(rank.max()) + 1), -1)
    table[row, key, rank] = unit
    return table


def _match(overlap: np.ndarray, max_rounds: int = 8) -> np.ndarray:
    """[X, U, U] overlap of new unit u with old unit v → [X, U] the old unit of each new unit:
    up to ``max_rounds`` rounds in which new and old units that are each other's best choice
    pair up, then the rest in index order. Greedy rather than an optimal assignment; close to it
    when little changed."""
    num_rows, units, _ = overlap.shape
    score = overlap.copy()
    target = np.full((num_rows, units), -1)
    taken = np.zeros((num_rows, units), dtype=bool)
    for _ in range(min(units, max_rounds)):
        best_old = score.argmax(2)  # [X, U] for each new unit
        best_new = score.argmax(1)  # [X, U] for each old unit
        best_value = np.take_along_axis(score, best_old[:, :, None], 2)[..., 0]
        mutual = (np.take_along_axis(best_new, best_old, 1) == np.arange(units)) & (best_value > 0)
        row, unit = np.nonzero(mutual)
        if not len(row):
            break
        target[row, unit] = best_old[row, unit]
        taken[row, best_old[row, unit]] = True
        score[row, unit, :] = -1  # matched units are out of the game
        score[row, :, best_old[row, unit]] = -1
    return _pair_in_order(target, taken)


def _pair_in_order(target: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """[X, n] places (-1: none yet) and [X, n] taken places → every entry placed: those without
    a place take the free places in index order."""
    unplaced_first = np.argsort(target >= 0, axis=1, kind="stable")
    free_first = np.argsort(taken, axis=1, kind="stable")
    num_unplaced = (target < 0).sum(1, keepdims=True)
    first = np.arange(target.shape[1]) < num_unplaced
    fill = np.where(first, free_first, np.take_along_axis(target, unplaced_first, 1))
    out = target.copy()
    np.put_along_axis(out, unplaced_first, fill, 1)
    return out


def _keep_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """[X, S] experts of each GPU → ``new`` reordered so that an expert (its k-th copy) that the
    GPU held before stays in the slot that held it."""
    same = (new[:, :, None] == old[:, None, :]) & (
        _occurrence(new)[:, :, None] == _occurrence(old)[:, None, :]
    )  # [X, S_new, S_old]
    target = np.where(same.any(2), same.argmax(2), -1)
    target = _pair_in_order(target, same.any(1))
    out = np.empty_like(new)
    np.put_along_axis(out, target, new, 1)
    return out


def _warm_start(
    prev: np.ndarray, loads: np.ndarray, layout: _Layout
) -> tuple[np.ndarray, np.ndarray]:
    """``prev`` [L, R] brought up to date with few changes: each domain's replica counts become
    what a fresh placement would give (one rewritten slot per replica that moves, see
    ``_recount``), then duplicates are repaired and the heaviest GPUs relieved by swaps (two
    slots each). → (that placement, [L] whether ``prev`` is valid for this layout at all;
    layers where it is not keep ``prev``)."""
    num_layers = len(prev)
    domains, per_domain = layout.num_domains, layout.experts_per_domain
    slots = prev.reshape(num_layers * domains, layout.slots_per_domain)  # [X, P]
    present = _row_counts(slots, layout.num_logical_experts) > 0  # [X, E]
    usable = (present.sum(1) == per_domain).reshape(num_layers, domains).all(1)
    if domains > 1:
        usable &= _groups_stay_on_nodes(prev, layout)
    rows = np.flatnonzero(np.repeat(usable, domains))
    if not len(rows):
        return prev.copy(), usable
    # domain-local ids: the k-th expert (ascending) of a domain is k
    experts = np.argsort(~present[rows], axis=1, kind="stable")[:, :per_domain]  # [x, En]
    local = np.zeros((len(rows), layout.num_logical_experts), dtype=np.int64)
    np.put_along_axis(local, experts, np.arange(per_domain)[None], 1)
    local_slots = np.take_along_axis(local, slots[rows], 1)  # [x, P]
    domain_loads = np.take_along_axis(loads[rows // domains], experts, 1)  # [x, En]
    counts = _replica_counts(domain_loads, layout.slots_per_domain, layout.gpus_per_domain)
    local_slots = _recount(local_slots, domain_loads, counts, layout.slots_per_gpu)
    shape = (len(rows), layout.gpus_per_domain, layout.slots_per_gpu)
    slot_load = np.take_along_axis(domain_loads / counts, local_slots, 1)
    bins = _Bins.build(slot_load.reshape(shape), local_slots.reshape(shape), per_domain)
    _repair(bins)
    _refine(bins, max_rounds=64)  # more rounds than a fresh placement: it starts further off
    out = slots.copy()
    out[rows] = np.take_along_axis(experts, bins.key.reshape(len(rows), -1), 1)
    return out.reshape(prev.shape), usable


def _recount(slots: np.ndarray, loads: np.ndarray, counts: np.ndarray, per_gpu: int) -> np.ndarray:
    """[X, P] slots → the same with ``counts`` [X, n] replicas per expert: surplus replicas
    (those on the heaviest GPUs) make room for missing ones, heaviest per replica into the
    lightest GPU. May put two replicas of one expert on a GPU (``_repair`` fixes that)."""
    num_rows, num_slots = slots.shape
    old = _row_counts(slots, loads.shape[1])
    gpu = np.arange(num_slots) // per_gpu
    slot_load = np.take_along_axis(loads / old, slots, 1)
    gpu_load = slot_load.reshape(num_rows, -1, per_gpu).sum(-1)  # [X, GPUs]
    # per expert, replicas on the heaviest GPUs first; the first (old - counts) of them go
    by_expert = np.lexsort((-gpu_load[:, gpu], slots), axis=1)
    expert = np.take_along_axis(slots, by_expert, 1)
    first = np.cumsum(old, 1) - old  # [X, n] where each expert's run starts
    rank = np.arange(num_slots) - np.take_along_axis(first, expert, 1)
    drop = np.zeros_like(slots, dtype=bool)
    surplus = np.take_along_axis(old - counts, expert, 1)
    np.put_along_axis(drop, by_expert, rank < surplus, 1)
    # freed slots, lightest GPU first (after the drops), paired with missing replicas,
    # heaviest first; both lists are grouped by row and as long as each other in every row
    gpu_load -= np.where(drop, slot_load, 0.0).reshape(gpu_load.shape[0], -1, per_gpu).sum(-1)
    row, slot = np.nonzero(drop)
    freed = np.lexsort((gpu_load[row, gpu[slot]], row))
    missing = np.maximum(counts - old, 0)
    need_row, need_expert = np.nonzero(missing)
    repeats = missing[need_row, need_expert]
    need_row, need_expert = np.repeat(need_row, repeats), np.repeat(need_expert, repeats)
    need = np.lexsort((-(loads / counts)[need_row, need_expert], need_row))
    out = slots.copy()
    out[row[freed], slot[freed]] = need_expert[need]
    return out


def _groups_stay_on_nodes(phy2log: np.ndarray, layout: _Layout) -> np.ndarray:
    """[L] whether all slots of each expert group lie on one node (the hierarchical policy)."""
    group = phy2log // (layout.num_logical_experts // layout.num_groups)  # [L, R]
    node = np.broadcast_to(np.arange(layout.num_replicas) // layout.slots_per_domain, group.shape)
    some_node = np.full((len(phy2log), layout.num_groups), -1)
    np.put_along_axis(some_node, group, node, 1)  # the node of one slot of each group
    return (np.take_along_axis(some_node, group, 1) == node).all(1)
