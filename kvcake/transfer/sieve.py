"""SIEVE eviction (Zhang et al., NSDI '24), the policy the paper's engine uses for its endpoint pool.

Entries sit in insertion order, oldest first. A hit only sets a `visited` bit (no reordering, so a
hit is O(1) and lock-free in spirit). To evict, a hand walks from where it last stopped towards
newer entries, wrapping to the oldest: a visited entry loses its bit and survives, the first
unvisited one is evicted and the hand stays at its position. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SieveCache(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: list[K] = []  # oldest first
        self._values: dict[K, V] = {}
        self._visited: dict[K, bool] = {}
        self._hand = 0  # index into _keys of the next eviction candidate

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def keys(self) -> list[K]:
        """Keys, oldest first."""
        return list(self._keys)

    def get(self, key: K) -> V | None:
        """The value for `key` (marking it visited), or None when absent."""
        if key not in self._values:
            return None
        self._visited[key] = True
        return self._values[key]

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Insert or replace `key`; return the entries evicted to make room (at most one)."""
        if key in self._values:
            self._values[key] = value
            self._visited[key] = True
            return []
        evicted = [self._evict()] if len(self._keys) >= self.capacity else []
        self._keys.append(key)
        self._values[key] = value
        self._visited[key] = False
        return evicted

    def pop(self, key: K) -> V | None:
        """Remove `key` (a broken endpoint, say) and return its value, or None when absent."""
        if key not in self._values:
            return None
        index = self._keys.index(key)
        del self._keys[index]
        if index < self._hand:
            self._hand -= 1
        del self._visited[key]
        return self._values.pop(key)

    def _evict(self) -> tuple[K, V]:
        while True:
            if self._hand >= len(self._keys):
                self._hand = 0
            key = self._keys[self._hand]
            if not self._visited[key]:
                break
            self._visited[key] = False
            self._hand += 1
        del self._keys[self._hand]
        del self._visited[key]
        return key, self._values.pop(key)
