"""Read leases on one object (`ObjectMeta.leases`: lease id -> end, on the master's clock), pure.

A get takes a lease that keeps the object's replicas from eviction and reuse until its reader
releases it or it ends; `StoreIndex` takes and releases them, `NodeSpace` defers a removed range's
free until the leases running on it end.
"""

from __future__ import annotations

from kvcake.store.objects import ObjectMeta


def drop_expired(leases: dict[int, float], now_s: float) -> None:
    """Forget the leases on one object that ended by `now_s`. Each lease runs `lease_s` from
    the get that took it and the dict keeps insertion order, so the ended ones are the oldest:
    dropping from the front costs O(1) per get, where rebuilding the dict made a hot key's
    unreleased reads quadratic. (Should the clock step back, a lease left behind is harmless:
    every reader checks `end > now_s`.)"""
    while leases:
        oldest = next(iter(leases))
        if leases[oldest] > now_s:
            return
        del leases[oldest]


def readers(meta: ObjectMeta, now_s: float) -> frozenset[int]:
    """The ids of the read leases on `meta` still running at `now_s`."""
    return frozenset(i for i, end in meta.leases.items() if end > now_s)
