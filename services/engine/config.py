"""EngineConfig: what one engine instance runs and how much it may hold. No torch: the CLI
builds it from flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 << 20


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # preset name or HF checkpoint directory
    # tokens per KV block; None: the model's (64, FlashMLA's page, rounded up to a multiple of
    # DeepSeek-V4's compression ratios)
    block_size: int | None = None
    num_kv_blocks: int | None = None  # exact cache size; wins over kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # cache budget; default 512 MiB
    max_num_seqs: int = 256  # running sequences per step
    max_num_batched_tokens: int = 2048  # tokens (decode + prefill chunks) per step
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    device: str = "cpu"
    seed: int = 0  # for requests that sample without a seed of their own
    # Test knob: skew the router on purpose (seeded; see DeepseekV3ForCausalLM.skew_routing), so
    # that expert load is uneven on random weights and EPLB has something to balance.
    router_skew: float = 0.0
    # True: every step runs eagerly. False (the default): decode steps of up to
    # ``max_graph_batch`` sequences run compiled graphs (decode_graphs.py), compiled at start-up.
    # FERRY_ENFORCE_EAGER=1 changes the default (the test suite runs eager unless a test asks).
    enforce_eager: bool = field(
        default_factory=lambda: os.environ.get("FERRY_ENFORCE_EAGER", "0") == "1"
    )
    max_graph_batch: int = 16
    # Eager steps of fewer new tokens than this run on one torch thread (0: every step on all).
    # A prefill worker's steps of a few hundred tokens gain little from a second thread, whose
    # split products and spinning through the serial parts cost CPU that a decode worker could
    # use (`loadtest/results/peer-llamacpp.json` runs with it).
    one_thread_below: int = 0
    # False: no decode graphs (a prefill worker never decodes), but the eager steps still get
    # their compiled pieces (piece_graphs.py) unless ``enforce_eager``
    decode_graphs: bool = True

    def __post_init__(self) -> None:
        if self.block_size is not None and not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size={self.block_size}: must be in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.max_graph_batch < 1:
            raise ValueError("max_graph_batch must be at least 1")
        if self.one_thread_below < 0:
            raise ValueError("one_thread_below must be >= 0")
        if self.router_skew < 0:
            raise ValueError("router_skew must be >= 0")

    def num_blocks_for(self, bytes_per_block: int, reserved_bytes: int = 0) -> int:
        """Cache size in blocks: ``num_kv_blocks``, else as many as the memory budget holds
        after ``reserved_bytes`` (the state slots)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        if reserved_bytes >= budget:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} does not cover the {reserved_bytes} bytes of "
                f"state slots (one per sequence, max_num_seqs={self.max_num_seqs}): raise the "
                "budget or lower max_num_seqs"
            )
        budget -= reserved_bytes
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block ({bytes_per_block} bytes each)"
            )
        return int(blocks)
