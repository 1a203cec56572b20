"""The chained block hashes that name a prompt prefix: a full block of ``block_size`` tokens is
named by (its parent block's hash, its token ids, a salt naming the model). Workers index their
prefix caches by these hashes and schedulers route by them, so both compute them here, with no
torch: 64-bit blake2b, the same in every process."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

ROOT_HASH = 0
DEFAULT_SALT = b"ferry"


def hash_block(parent: int, token_ids: Sequence[int], salt: bytes) -> int:
    h = hashlib.blake2b(digest_size=8, key=salt[:64])
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes = DEFAULT_SALT
) -> Iterator[int]:
    """The hashes of the full blocks of ``token_ids``, first block first (lazily, so a caller
    can stop at the first miss). An empty ``salt`` is the default one."""
    salt = salt or DEFAULT_SALT
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        yield parent
