"""The LRU block cache."""

from __future__ import annotations

import pytest

from kvcake.sim.cache import BlockLRU


def test_match_len_counts_leading_keys() -> None:
    c = BlockLRU(10)
    c.insert([1, 2, 3, 7])
    assert c.match_len([1, 2, 3, 4, 7]) == 3
    assert c.match_len([2, 1]) == 2
    assert c.match_len([9, 1]) == 0


def test_lru_evicts_least_recently_used_first() -> None:
    c = BlockLRU(3)
    assert c.insert([1, 2, 3]) == []
    c.touch([1])  # order now 2, 3, 1
    assert c.insert([4]) == [2]
    assert c.insert([5, 6]) == [3, 1]
    assert list(c._keys) == [4, 5, 6]
    assert c.resize(1) == [4, 5]
    with pytest.raises(ValueError, match="capacity"):
        c.resize(-1)
    assert c.insert([7]) == [6]  # still works after the refused resize
