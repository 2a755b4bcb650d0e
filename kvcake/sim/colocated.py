"""The colocated (vLLM-like) instance's side of a request: its HBM prefix cache.

A colocated instance prefills and decodes on one node. Its prefix cache lives in the HBM its
batch does not reserve, so it shrinks (evicting LRU blocks) as the batch grows.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcake.sim.cache import BlockLRU
from kvcake.sim.decode import DecodeInstance, Seq
from kvcake.sim.events import Event
from kvcake.sim.records import RequestState


def place_colocated(instance: DecodeInstance, cache: BlockLRU, state: RequestState,
                    block_size: int, now_s: float) -> list[Event]:
    """Queue the request's prefill on `instance`, its cached prefix (`cache`) skipped; it then
    decodes there."""
    a = state.arrival
    matched = cache.match_len(a.block_keys)
    cache.touch(a.block_keys[:matched])
    state.prefix_len = min(matched * block_size, a.input_len - 1)
    seq = Seq(state.index, a.input_len, max(0, a.output_len - 1), a.input_len + a.output_len,
              now_s, state.gaps, prefill_done_len=state.prefix_len, prefix_len=state.prefix_len)
    event = instance.add_prefill(now_s, seq)
    return [] if event is None else [event]


def cache_in_free_hbm(instance: DecodeInstance, cache: BlockLRU, keys: Sequence[int],
                      kv_capacity_tokens: int, block_size: int) -> list[int]:
    """Cache a prompt's blocks in `instance`'s free HBM (LRU); return the keys evicted."""
    free = max(0, kv_capacity_tokens - instance.reserved_tokens)
    evicted = cache.resize(free // block_size)
    evicted += cache.insert(keys)
    return evicted
