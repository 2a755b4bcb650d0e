"""An LRU cache of KV blocks, counted in blocks (the trace's 512-token hash blocks).

Used for a prefill instance's local prefix cache, for the pooled global store tier and for a
colocated instance's HBM prefix cache. Keys are chained prefix hashes, so a prompt's reusable
part is the longest run of its leading keys that are present.

Simplification: blocks of the request being computed are not pinned. The cache is sized in
millions of tokens and one request holds at most a few hundred blocks, so an eviction of a block
in use does not happen in practice at the capacities the CLI accepts (>= one maximal prompt).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockLRU:
    """Block keys in least- to most-recently-used order, at most `capacity_blocks` of them."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"cache capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def match_len(self, keys: Sequence[int]) -> int:
        """Number of leading `keys` present (a chained key implies its whole prefix)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[int]) -> None:
        """Mark present `keys` as just used."""
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)

    def insert(self, keys: Sequence[int]) -> list[int]:
        """Add (or refresh) `keys` as most recently used; return the keys evicted to make room.

        A key inserted by this call is never among those it evicts unless `keys` alone exceeds
        the capacity, in which case only its last `capacity_blocks` keys stay.
        """
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)
            else:
                self._keys[key] = None
        evicted: list[int] = []
        while len(self._keys) > self.capacity_blocks:
            evicted.append(self._keys.popitem(last=False)[0])
        return evicted

    def resize(self, capacity_blocks: int) -> list[int]:
        """Change the capacity; return the keys evicted by a shrink."""
        if capacity_blocks < 0:
            raise ValueError(f"cache capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        return self.insert(())
