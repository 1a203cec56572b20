"""Paged KV cache bookkeeping: a reference-counted block pool with prefix caching, and the state
slots of models that keep per-request state (DeepSeek-V4's window and compressor rows).

The cache tensors (the groups of ``model/cache_spec.py``) are owned by the engine; this module
decides which blocks and which state slot each request uses. Every group shares one block table.
A full block is identified by a chained hash of (parent block's hash, its token ids, a salt naming
the model), so two requests that share a prefix share its blocks. Blocks no request references
stay *cached* (findable by hash) until the pool needs them, oldest first (LRU).

For a model with state, a prefix hit also needs the state at the end of its last block:
*snapshots* of it are kept by that block's hash (a fixed number, least recently used first out),
and a hit is only as long as the longest cached prefix whose end has one. The state is a function
of the prefix's tokens, so a snapshot stays exact for as long as it is kept, whatever happens to
the blocks.

A worker that asks for them (:meth:`KVCacheManager.record_events`) gets a KV event for every hash
that becomes findable (stored) or is evicted (removed); schedulers follow these to route a prompt
to the worker that holds its prefix (see services/scheduler/prefix_index.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Protocol

from ferry.services.common.prefix_hash import DEFAULT_SALT, ROOT_HASH, hash_block, prefix_hashes
from ferry.services.engine.request import Request


class BlockPool:
    """Reference counts, the hash index and the LRU queue of unreferenced blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Unreferenced blocks, least recently freed first; never-used blocks come first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # of those, the ones that still hold a hash: kept as blocks move, because counting them
        # every step is O(num_blocks), a visible share of a small model's decode step
        self.num_cached_free = 0
        # (True: stored, False: removed; hash) in order, while a worker follows them
        self.events: deque[tuple[bool, int]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (plain free plus evictable cached)."""
        return len(self.free)

    def take_new(self) -> int:
        """An unreferenced block for new content; evicts its cached hash if it had one."""
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            self.num_cached_free -= 1
            del self.hash_to_block[old]
            self.block_hash[block] = None
            if self.events is not None:
                self.events.append((False, old))
        self.ref_count[block] = 1
        return block

    def take_cached(self, block: int) -> None:
        """Reference a cached block found by hash (it may be unreferenced or shared), or any
        block a hold pins."""
        if self.ref_count[block] == 0:
            del self.free[block]
            self.num_cached_free -= self.block_hash[block] is not None  # a hold may pin any
        self.ref_count[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                self.num_cached_free += self.block_hash[block] is not None

    def register(self, block: int, block_hash: int) -> None:
        """Make a just-filled block findable by hash, unless another block already holds it."""
        if block_hash not in self.hash_to_block and self.block_hash[block] is None:
            self.hash_to_block[block_hash] = block
            self.block_hash[block] = block_hash
            self.num_cached_free += self.ref_count[block] == 0
            if self.events is not None:
                self.events.append((True, block_hash))


class KvHolds(Protocol):
    """The part of a KVCacheManager that other threads may call (KV leases and imports run on
    the event loop and transport threads while the engine steps): references to blocks held
    under a key, outside any request. Each call takes the manager's lock."""

    def hold(self, key: str, block_ids: list[int]) -> None: ...

    def hold_new(self, key: str, num_blocks: int) -> list[int] | None: ...

    def rename_hold(self, key: str, new_key: str) -> list[int] | None: ...

    def release_hold(self, key: str) -> list[int]: ...


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        num_state_slots: int = 0,
        num_snapshots: int = 0,
        num_state_blocks: int = 0,
    ) -> None:
        """``num_state_slots`` > 0: every request that runs also holds one state slot, and a
        prefix hit needs one of ``num_snapshots`` snapshots; a hand-off also reserves
        ``num_state_blocks`` blocks, into which its slot is packed for the decode worker."""
        self.pool = BlockPool(num_blocks)
        self.num_state_slots = num_state_slots
        self.num_state_blocks = num_state_blocks if num_state_slots else 0
        self.free_slots = list(range(num_state_slots))
        self.num_snapshots = num_snapshots if enable_prefix_caching else 0
        self.free_snapshots = list(range(self.num_snapshots))
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # block hash -> id, LRU first
        # (True: kept, False: dropped; the block hash) in order, while a worker follows them
        self.snapshot_events: deque[tuple[bool, int]] | None = None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt or DEFAULT_SALT
        # Leases and KV transfers touch the pool from transport threads; the engine from its own.
        self.lock = threading.RLock()
        # Blocks referenced outside any request (KV leases, in-flight imports), by owner key.
        self.holds: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def record_events(self) -> None:
        """From now on, keep a KV event for every hash stored or removed, until taken by
        :meth:`take_events` (off by default: nobody would take them)."""
        with self.lock:
            if self.pool.events is None:
                self.pool.events = deque()
            if self.snapshot_events is None:
                self.snapshot_events = deque()

    def take_events(self, snapshot: bool = False) -> list[tuple[bool, int]]:
        """The KV events since the last call, oldest first: (stored, block hash). With
        ``snapshot``, instead, every hash findable now as stored (for a follower that starts
        over: it lost events, or the worker just started)."""
        with self.lock:
            pool = self.pool
            if snapshot:
                events = [(True, h) for h in pool.hash_to_block]
            else:
                events = list(pool.events or ())
            if pool.events is not None:
                pool.events.clear()
        return events

    def take_snapshot_events(self, snapshot: bool = False) -> list[tuple[bool, int]]:
        """As :meth:`take_events`, for the state snapshots: (kept, hash of the block they end);
        with ``snapshot``, every snapshot kept now."""
        with self.lock:
            if snapshot:
                events = [(True, h) for h in self.snapshots]
            else:
                events = list(self.snapshot_events or ())
            if self.snapshot_events is not None:
                self.snapshot_events.clear()
        return events

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, req: Request) -> tuple[list[int], list[int]]:
        """Cached blocks holding the longest prefix of ``req``'s tokens, leaving at least one
        token to compute (its logits are needed); with state, only as far as the last block
        whose end has a snapshot. Returns (block ids, their hashes); none for a request that
        wants its prompt's logprobs: it needs the logits of every prompt token."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return [], []
        tokens = req.all_token_ids
        blocks: list[int] = []
        hashes: list[int] = []
        usable = 0  # with state: up to the last block whose end has a snapshot
        with self.lock:
            for block_hash in prefix_hashes(tokens[: len(tokens) - 1], self.block_size, self.salt):
                block = self.pool.hash_to_block.get(block_hash)
                if block is None:
                    break
                blocks.append(block)
                hashes.append(block_hash)
                if block_hash in self.snapshots:
                    usable = len(blocks)
        if self.num_state_slots:
            return blocks[:usable], hashes[:usable]
        return blocks, hashes

    def allocate(
        self, req: Request, num_new_tokens: int, cached: tuple[list[int], list[int]] = ([], [])
    ) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens, first taking the prefix blocks
        ``cached`` (from :meth:`match_prefix`, only for a request that holds no block yet).
        Returns False, changing nothing, when the pool is too small."""
        cached_blocks, cached_hashes = cached
        have = len(req.block_ids) + len(cached_blocks)
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        new = max(0, self.blocks_needed(total) - have)
        with self.lock:
            reclaim = sum(1 for b in cached_blocks if self.pool.ref_count[b] == 0)
            starts = self.num_state_slots and req.state_slot is None
            reserve = self.num_state_blocks if starts and req.hand_off else 0
            if new + reserve > self.pool.num_free - reclaim:
                return False
            if starts:
                if not self.free_slots:
                    return False
                req.state_slot = self.free_slots.pop()
                req.state_block_ids = [self.pool.take_new() for _ in range(reserve)]
            if self.num_state_slots and cached_hashes:
                req.restore_snapshot = self.snapshots[cached_hashes[-1]]
                self.snapshots.move_to_end(cached_hashes[-1])
            for block in cached_blocks:
                self.pool.take_cached(block)
            req.block_ids.extend(cached_blocks)
            req.block_hashes.extend(cached_hashes)
            req.block_ids.extend(self.pool.take_new() for _ in range(new))
            return True

    def commit(self, req: Request) -> None:
        """Register the hashes of ``req``'s blocks that its computed tokens have just filled."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = req.num_computed_tokens // bs
        if full <= len(req.block_hashes):
            return
        tokens = req.all_token_ids
        parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
        with self.lock:
            for i in range(len(req.block_hashes), full):
                parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], self.salt)
                req.block_hashes.append(parent)
                self.pool.register(req.block_ids[i], parent)

    def free(self, req: Request) -> None:
        """Drop ``req``'s references, tail first so that its last blocks are evicted first, and
        its state slot."""
        with self.lock:
            self.pool.release(reversed(req.block_ids))
            self.pool.release(req.state_block_ids)
            if req.state_slot is not None:
                self.free_slots.append(req.state_slot)
        req.block_ids = []
        req.block_hashes = []
        req.state_slot = None
        req.state_block_ids = []
        req.restore_snapshot = None

    # ---- state snapshots (models with state rings) ----------------------------------------
    def take_snapshot(self) -> int | None:
        """A snapshot id to copy a state into: a free one, else the least recently used one's
        (its prefix loses its hit); None when there are none."""
        with self.lock:
            if self.free_snapshots:
                return self.free_snapshots.pop()
            if not self.snapshots:
                return None
            block_hash, snap = self.snapshots.popitem(last=False)
            if self.snapshot_events is not None:
                self.snapshot_events.append((False, block_hash))
            return snap

    def keep_snapshot(self, block_hash: int | None, snap: int) -> None:
        """Keep ``snap`` as the state at the end of the block ``block_hash`` (None: the block
        was not hashed; a hash that has one already keeps it): else it is free again."""
        with self.lock:
            if block_hash is None or block_hash in self.snapshots:
                self.free_snapshots.append(snap)
            else:
                self.snapshots[block_hash] = snap
                if self.snapshot_events is not None:
                    self.snapshot_events.append((True, block_hash))

    # ---- references held outside requests (KV transfer) -----------------------------------
    def hold(self, key: str, block_ids: list[int]) -> None:
        """Add a reference to ``block_ids`` under ``key``: a lease pins a request's blocks past
        the request's end (unreferenced blocks are taken out of the free queue)."""
        with self.lock:
            if key in self.holds:
                raise KeyError(f"hold {key!r} exists")
            for b in block_ids:
                self.pool.take_cached(b)
            self.holds[key] = list(block_ids)

    def hold_new(self, key: str, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` fresh blocks under ``key`` (an import's destination); None if the
        pool is too small."""
        with self.lock:
            if key in self.holds:
                raise KeyError(f"hold {key!r} exists")
            if num_blocks > self.pool.num_free:
                return None
            blocks = [self.pool.take_new() for _ in range(num_blocks)]
            self.holds[key] = blocks
            return list(blocks)

    def rename_hold(self, key: str, new_key: str) -> list[int] | None:
        """Move the hold ``key`` to ``new_key`` (atomically: no moment where nobody holds the
        blocks); returns its blocks, or None when ``key`` is not held."""
        with self.lock:
            if new_key in self.holds:
                raise KeyError(f"hold {new_key!r} exists")
            blocks = self.holds.pop(key, None)
            if blocks is not None:
                self.holds[new_key] = blocks
            return None if blocks is None else list(blocks)

    def release_hold(self, key: str) -> list[int]:
        """Drop the references held under ``key``; returns the blocks (empty if none)."""
        with self.lock:
            blocks = self.holds.pop(key, [])
            self.pool.release(reversed(blocks))
            return blocks

    def adopt_hold(self, key: str, req: Request, num_tokens: int) -> list[int]:
        """Hand the blocks held under ``key`` to ``req`` as its first ``num_tokens`` tokens.
        With state, the hold ends with the ``num_state_blocks`` blocks its state was packed in:
        ``req`` gets a state slot, and those blocks are returned, still held by ``req``
        (:attr:`Request.state_block_ids`) until the caller unpacks them and calls
        :meth:`drop_state_blocks`. KeyError when the hold is gone; ValueError (nothing taken)
        when no state slot is free."""
        with self.lock:
            blocks = self.holds[key]
            k = self.num_state_blocks
            if k and not self.free_slots:
                raise ValueError(f"no free state slot for {req.request_id}")
            del self.holds[key]
            req.block_ids = blocks[: len(blocks) - k]
            req.block_hashes = []
            req.num_computed_tokens = num_tokens
            if k:
                req.state_slot = self.free_slots.pop()
                req.state_block_ids = blocks[len(blocks) - k :]
            return list(req.state_block_ids)

    def drop_state_blocks(self, req: Request) -> None:
        """Free the blocks ``req``'s state came in (or was reserved in)."""
        with self.lock:
            self.pool.release(req.state_block_ids)
        req.state_block_ids = []

    def check_integrity(self, live: Iterable[Request] = ()) -> None:
        """free + cached + in use == total; reference counts equal what the live requests and
        the holds (leases, imports) reference; every state slot is free or held by one live
        request, and every request with computed tokens holds one."""
        with self.lock:
            self._check_integrity(list(live))

    def _check_integrity(self, live: list[Request]) -> None:
        pool = self.pool
        holders = [0] * pool.num_blocks
        for held in self.holds.values():
            for b in held:
                holders[b] += 1
        for req in live:
            held = req.block_ids + req.state_block_ids
            if len(set(held)) != len(held):
                raise AssertionError(f"request {req.request_id} holds a block twice")
            for b in held:
                holders[b] += 1
        if holders != pool.ref_count:
            bad = next(
                i for i, (h, r) in enumerate(zip(holders, pool.ref_count, strict=True)) if h != r
            )
            raise AssertionError(
                f"block {bad}: ref_count {pool.ref_count[bad]}, held {holders[bad]} times"
            )
        self._check_slots(live)
        in_use = sum(1 for r in pool.ref_count if r > 0)
        unreferenced = {b for b in range(pool.num_blocks) if pool.ref_count[b] == 0}
        if unreferenced != set(pool.free):
            raise AssertionError("free queue differs from the unreferenced blocks")
        cached = sum(1 for b in unreferenced if pool.block_hash[b] is not None)
        if cached != pool.num_cached_free:
            raise AssertionError(f"{cached} cached free blocks, counted {pool.num_cached_free}")
        plain_free = len(unreferenced) - cached
        if plain_free + cached + in_use != pool.num_blocks:
            raise AssertionError("free + cached + in use != total")
        for h, b in pool.hash_to_block.items():
            if pool.block_hash[b] != h:
                raise AssertionError(f"hash index names block {b} for a hash it does not hold")

    def _check_slots(self, live: list[Request]) -> None:
        held = [r.state_slot for r in live if r.state_slot is not None]
        if sorted(held + self.free_slots) != list(range(self.num_state_slots)):
            raise AssertionError(f"state slots: held {sorted(held)}, free {self.free_slots}")
        kept = list(self.snapshots.values())
        if sorted(kept + self.free_snapshots) != list(range(self.num_snapshots)):
            raise AssertionError(f"snapshots: kept {sorted(kept)}, free {self.free_snapshots}")
        if self.num_state_slots:
            for r in live:
                if r.num_computed_tokens and r.state_slot is None:
                    raise AssertionError(f"request {r.request_id} has no state slot")

    def usage(self) -> dict[str, int]:
        pool = self.pool
        with self.lock:
            cached = pool.num_cached_free
            num_free = pool.num_free
        return {
            "total": pool.num_blocks,
            "in_use": pool.num_blocks - num_free,
            "cached": cached,
            "free": num_free - cached,
        }
