"""Chained prefix hashing of token blocks: the one definition everyone uses.

key_0 = H(namespace_seed, tokens[0:B]),  key_i = H(key_{i-1}, tokens[i*B:(i+1)*B])

so a key names its block *and everything before it*. The same key names a page in an engine's
prefix cache, an object in the store and an entry in the Conductor's index. Only full blocks get
keys: a partial last block is never shared. The namespace names the model and the KV layout
(model, dtype, block size), so blocks of different models never collide.

Pure: no torch, no clock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvcake.types import BlockKey

_DIGEST_BYTES = 8


def namespace_seed(namespace: str) -> BlockKey:
    """The parent key of the first block of every prompt in `namespace`."""
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=_DIGEST_BYTES).digest()
    return BlockKey(int.from_bytes(digest, "little"))


def hash_block(parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
    """Key of one block given its parent's key. Token ids must fit in 32 bits unsigned."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(int(parent).to_bytes(_DIGEST_BYTES, "little"))
    h.update(array("I", token_ids).tobytes())
    return BlockKey(int.from_bytes(h.digest(), "little"))


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str = "",
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of every *full* block of `token_ids`, chained from `parent` (or the namespace seed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    key = namespace_seed(namespace) if parent is None else parent
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash_block(key, token_ids[start : start + block_size])
        keys.append(key)
    return keys


def key_hex(key: BlockKey) -> str:
    """Stable printable form of a key, used as (part of) a store object name."""
    return f"{int(key):016x}"
