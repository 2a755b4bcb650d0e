"""Keeps the Conductor's holder "store" true: blocks the store dropped stop being listed.

Why polling: the store master evicts (LRU above its watermark), removes, and drops the
replicas of dead nodes on its own, and its public API reports none of it; the frontend already
knows exactly which keys it told the Conductor the store holds (from `StoreEvents`). So the
audit keeps those keys in an ordered map and, each round, asks the master `exists_batch` about
at most `max_keys` of them, oldest-checked first (round robin), and reports the missing ones
removed. The cost is bounded: one master round trip per round, `max_keys` keys; a block gone
from the store stays listed at most one full cycle (tracked / max_keys rounds). Until then a
fetch planned for it falls back to recompute (the prefill worker imports what it could read),
which costs time, never tokens; `suspect()` moves the keys of such a short fetch to the front,
so they are checked in the next round.

Races: a key stored again between the master's answer and the report must stay listed, so each
tracking entry carries a generation, and a removal is reported only if the generation is the
one that was checked. Memory is bounded by `max_tracked`: past it the oldest-checked keys are
reported removed without asking (a possible miss, never a wrong fetch).

A block a CPP group stored is held as slices of its layers, one object per stage
(block_fetch.range_key): tracked with those slices, it is present while its whole object or
every one of its slices is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from itertools import count
from typing import Any

from kvcake.server.worker.block_fetch import block_key, range_key
from kvcake.store import StoreError

log = logging.getLogger(__name__)

ExistsBatch = Callable[[Sequence[str]], list[bool]]


class StoreAudit:
    """Not thread-safe: the backend calls `track` and `suspect` under its lock; `run_round`
    takes that lock around the bookkeeping and makes the master round trip without it."""

    def __init__(self, namespace: str, max_keys: int, max_tracked: int = 1_000_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {max_keys}")
        self.namespace = namespace
        self.max_keys = max_keys
        self.max_tracked = max_tracked
        self._tracked: dict[int, int] = {}  # key -> generation; order: least recently checked
        self._slices: dict[int, tuple[range, ...]] = {}  # keys stored as layer slices
        self._generations = count(1)
        self.num_checked = 0
        self.num_removed = 0

    def __len__(self) -> int:
        return len(self._tracked)

    def track(self, keys: Sequence[int], slices: Sequence[range] = ()) -> list[int]:
        """The store holds `keys` (again): whole, or as the layer `slices` a CPP group's stages
        stored; returns keys dropped from tracking to stay bounded (the caller reports them
        removed)."""
        for key in keys:
            self._tracked.pop(key, None)
            self._tracked[key] = next(self._generations)  # checked last: it was just written
            if slices:
                self._slices[key] = tuple(slices)
            else:
                self._slices.pop(key, None)
        dropped = []
        while len(self._tracked) > self.max_tracked:
            key = next(iter(self._tracked))
            del self._tracked[key]
            self._slices.pop(key, None)
            dropped.append(key)
        self.num_removed += len(dropped)
        return dropped

    def suspect(self, keys: Sequence[int]) -> None:
        """Check these tracked keys first in the next round (e.g. a fetch came back short)."""
        front = {k: self._tracked[k] for k in keys if k in self._tracked}
        for key in front:
            del self._tracked[key]
        self._tracked = {**front, **self._tracked}

    def take_round(self) -> list[tuple[int, int]]:
        """Up to max_keys (key, generation) pairs to check now; they move to the back."""
        batch = []
        for key in list(self._tracked)[:self.max_keys]:
            generation = self._tracked.pop(key)
            self._tracked[key] = generation
            batch.append((key, generation))
        return batch

    def store_key(self, key: int) -> str:
        return block_key(self.namespace, key)

    def store_names(self, key: int) -> list[str]:
        """The objects that hold `key`: its whole block, then its layer slices if any."""
        return [self.store_key(key), *(range_key(self.namespace, key, r)
                                       for r in self._slices.get(key, ()))]

    def settle(self, batch: Sequence[tuple[int, int]], present: Sequence[bool]) -> list[int]:
        """The master's answers for `batch`; returns the keys to report removed."""
        gone = []
        for (key, generation), exists in zip(batch, present, strict=True):
            if not exists and self._tracked.get(key) == generation:
                del self._tracked[key]
                self._slices.pop(key, None)
                gone.append(key)
        self.num_checked += len(batch)
        self.num_removed += len(gone)
        return gone

    def run_round(self, exists_batch: ExistsBatch, lock: AbstractContextManager[Any],
                  report: Callable[[list[int]], None]) -> list[int]:
        """One audit round: check a batch with the master, `report(gone)` under `lock`.
        A master that does not answer skips the round (logged)."""
        with lock:
            batch = self.take_round()
            names = [self.store_names(k) for k, _ in batch]
        if not batch:
            return []
        try:
            found = exists_batch([n for each in names for n in each])
        except (StoreError, OSError) as exc:
            log.warning("store audit: the master did not answer (%s); next round", exc)
            return []
        present, at = [], 0
        for each in names:  # the whole block, or every slice of it
            mine = found[at:at + len(each)]
            at += len(each)
            present.append(mine[0] or (len(mine) > 1 and all(mine[1:])))
        with lock:
            gone = self.settle(batch, present)
            if gone:
                report(gone)
        return gone
