"""Trace-level cache analysis: the hit rate a single LRU prefix cache of a given size reaches.

This is the paper's Figure 9 question ("how big must the cache be"), answered by replaying the
trace through one cache shared by everything, with no scheduling and no timing: each request
reuses the longest run of its leading blocks found in the cache, then all its blocks are used.
"""

from __future__ import annotations

from kvcake.sim.cache import BlockLRU
from kvcake.sim.trace import Trace


def lru_hit_rate(trace: Trace, capacity_tokens: int | None) -> float:
    """Reused prompt tokens over all prompt tokens with one LRU cache (None: unlimited)."""
    block = trace.block_size
    total = reused = 0
    if capacity_tokens is None:
        seen: set[int] = set()
        for r in trace.requests:
            n = 0
            for key in r.hash_ids:
                if key not in seen:
                    break
                n += 1
            reused += min(n * block, r.input_len)
            total += r.input_len
            seen.update(r.hash_ids)
        return reused / total if total else 0.0
    cache = BlockLRU(capacity_tokens // block)
    for r in trace.requests:
        n = cache.match_len(r.hash_ids)
        reused += min(n * block, r.input_len)
        total += r.input_len
        cache.insert(r.hash_ids)
    return reused / total if total else 0.0
