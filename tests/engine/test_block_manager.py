"""Block manager: exact block ids, ref counts, eviction order and KV events."""

from __future__ import annotations

import pytest

from kvcake.engine.block_manager import BlockManager, KvEvent, KvEventKind
from kvcake.hashing import block_keys
from kvcake.types import BlockId, BlockKey

BS = 4


def keys(tokens: list[int]) -> list[BlockKey]:
    return block_keys(tokens, BS, "test")


def stored(*ks: BlockKey) -> list[KvEvent]:
    return [KvEvent(KvEventKind.STORED, k) for k in ks]


def test_allocate_cache_free_reuse_exact_ids() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = list(range(10))  # 2 full blocks + 2 tokens
    ka = keys(a)
    assert bm.allocate("a", len(a), ka) == 0
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5]
    bm.cache_full_blocks("a", ka)
    assert bm.drain_events() == stored(*ka)
    assert bm.drain_events() == []

    # b shares a's first block only.
    b = [0, 1, 2, 3, 9, 9, 9, 9, 7]
    kb = keys(b)
    assert bm.allocate("b", len(b), kb) == 4
    assert bm.block_ids("b") == [0, 3, 4]
    assert [bm.ref_count(BlockId(i)) for i in range(6)] == [2, 1, 1, 1, 1, 0]

    bm.free("a")  # last block first: 2 (no key) to the head, then 1 (keyed) to the tail
    assert bm.free_block_ids() == [2, 5, 1]
    assert bm.ref_count(BlockId(0)) == 1
    bm.free("b")
    # b never cached its own blocks: 4 then 3 go to the head; shared keyed block 0 to the tail.
    assert bm.free_block_ids() == [3, 4, 2, 5, 1, 0]
    assert bm.num_cached_blocks(ka) == 2


def test_cached_blocks_are_evicted_in_lru_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    x, y = [1] * 4, [2] * 4
    kx, ky = keys(x), keys(y)
    for rid, toks, ks in (("x", x, kx), ("y", y, ky)):
        assert bm.allocate(rid, len(toks) + 1, ks) == 0
        bm.cache_full_blocks(rid, ks)
    assert bm.block_ids("x") == [0, 1] and bm.block_ids("y") == [2, 3]
    bm.free("x")
    bm.free("y")
    # Empty blocks at the head (the latest freed first), then x's keyed block, then y's.
    assert bm.free_block_ids() == [3, 1, 0, 2]
    bm.drain_events()
    # A 12-token request needs 3 blocks: two empty ones, then the LRU cached block (x's).
    assert bm.allocate("z", 12, keys([5] * 12)) == 0
    assert bm.block_ids("z") == [3, 1, 0]
    assert bm.drain_events() == [KvEvent(KvEventKind.REMOVED, kx[0])]
    assert bm.lookup(kx[0]) is None and bm.lookup(ky[0]) == 2


def test_cache_hit_touches_block_and_recomputes_last_token() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    t = list(range(8))
    kt = keys(t)
    bm.allocate("a", 8, kt)
    bm.cache_full_blocks("a", kt)
    bm.free("a")
    assert bm.free_block_ids() == [2, 3, 1, 0]
    # Fully cached 8-token prompt: block 1 is not reused, one token must be computed.
    assert bm.allocate("b", 8, kt) == 4
    assert bm.block_ids("b") == [0, 2]
    assert bm.free_block_ids() == [3, 1]


def test_allocate_returns_none_and_changes_nothing_when_full() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    assert bm.allocate("a", 8, []) == 0
    assert bm.allocate("b", 8, []) is None
    assert bm.free_block_ids() == [2] and not bm.has("b")
    assert bm.append_slots("a", 12) is True and bm.block_ids("a") == [0, 1, 2]
    assert bm.append_slots("a", 13) is False and bm.block_ids("a") == [0, 1, 2]
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("a", 4, [])


def test_duplicate_key_stays_with_first_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    t = [3] * 5
    kt = keys(t)
    bm.allocate("a", 5, kt)
    bm.allocate("b", 5, kt)  # not cached yet: computes its own copy
    bm.cache_full_blocks("a", kt)
    bm.cache_full_blocks("b", kt)
    assert bm.lookup(kt[0]) == 0
    assert bm.drain_events() == stored(kt[0])
    bm.free("b")
    assert bm.free_block_ids()[:2] == [2, 3]  # b's unkeyed copies are reused first


def test_import_block_keys_a_free_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    k = keys([4] * 4)[0]
    assert bm.import_block(k) == 0
    assert bm.import_block(k) is None  # already cached
    assert bm.free_block_ids() == [1, 0] and bm.ref_count(BlockId(0)) == 0
    assert bm.allocate("a", 5, [k]) == 4 and bm.block_ids("a") == [0, 1]
    assert bm.drain_events() == stored(k)


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    t = list(range(8))
    bm.allocate("a", 8, keys(t))
    bm.cache_full_blocks("a", keys(t))
    bm.free("a")
    assert bm.allocate("b", 8, keys(t)) == 0
    assert bm.drain_events() == []
