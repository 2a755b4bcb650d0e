"""Eviction order: least recently used first, leased objects never, soft-pinned ones last.

Pure policy: the master tells it about accesses and asks it for victims.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class LruOrder:
    """Keys by last access. Exact LRU (an ordered dict is O(1) per access), which is at least as
    good as the sampled approximate LRU of MOONCAKE and Redis."""

    def __init__(self) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def __len__(self) -> int:
        return len(self._keys)

    def oldest_first(self) -> list[str]:
        return list(self._keys)

    def choose_victims(
        self,
        bytes_to_free: int,
        size_of: Callable[[str], int],
        is_leased: Callable[[str], bool],
        is_pinned: Callable[[str], bool],
    ) -> list[str]:
        """Oldest unleased keys whose sizes sum to at least `bytes_to_free`, unpinned ones
        before pinned ones (a pin is soft). Fewer if not enough can go."""
        victims: list[str] = []
        freed = 0
        pinned: list[str] = []
        for key in self._keys:
            if freed >= bytes_to_free:
                return victims
            if is_leased(key):
                continue
            if is_pinned(key):
                pinned.append(key)
                continue
            victims.append(key)
            freed += size_of(key)
        for key in pinned:
            if freed >= bytes_to_free:
                break
            victims.append(key)
            freed += size_of(key)
        return victims
