"""`RecentKeys`: the block keys a store writer has handed over lately, so a prompt's blocks are
not put twice; the oldest are forgotten past `limit` (a forgotten key is at worst put again,
and the store answers that it already holds it)."""

from __future__ import annotations

from collections.abc import Iterable


class RecentKeys:
    def __init__(self, limit: int = 200_000) -> None:
        if limit < 1:
            raise ValueError(f"limit: at least 1 key, got {limit}")
        self.limit = limit
        self._keys: dict[int, None] = {}  # insertion ordered: the oldest first

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[int]) -> None:
        """Remember `keys`, then forget the oldest beyond the limit."""
        for key in keys:
            self._keys[key] = None
        while len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]

    def forget(self, keys: Iterable[int]) -> None:
        """Forget `keys` (their put failed: the next prompt that has them puts them again)."""
        for key in keys:
            self._keys.pop(key, None)
