"""SIEVE: exact eviction order (the examples of Zhang et al., NSDI '24, worked by hand)."""

from __future__ import annotations

import pytest

from kvcake.transfer import SieveCache


def fill(cache: SieveCache[str, int], keys: str) -> list[str]:
    evicted: list[str] = []
    for key in keys:
        if cache.get(key) is None:
            evicted += [k for k, _ in cache.put(key, ord(key))]
    return evicted


def test_unvisited_oldest_goes_first() -> None:
    cache: SieveCache[str, int] = SieveCache(3)
    assert fill(cache, "abcd") == ["a"]
    assert cache.keys() == ["b", "c", "d"]


def test_visited_entries_survive_one_pass_of_the_hand() -> None:
    cache: SieveCache[str, int] = SieveCache(3)
    fill(cache, "abc")
    cache.get("a")
    cache.get("b")
    # hand starts at a (visited: cleared), b (visited: cleared), stops at c
    assert fill(cache, "d") == ["c"]
    assert cache.keys() == ["a", "b", "d"]
    # hand stays where c was (now d, unvisited): d goes next, not the older a
    assert fill(cache, "e") == ["d"]
    assert cache.keys() == ["a", "b", "e"]


def test_hand_wraps_to_the_oldest_entry() -> None:
    cache: SieveCache[str, int] = SieveCache(3)
    fill(cache, "abc")
    for key in "abc":
        cache.get(key)
    # every entry visited: the hand clears all three, wraps, and evicts a
    assert fill(cache, "d") == ["a"]
    assert cache.keys() == ["b", "c", "d"]
    assert fill(cache, "e") == ["b"]


def test_paper_sequence() -> None:
    cache: SieveCache[str, int] = SieveCache(4)
    evicted = fill(cache, "ABCDAB" + "E" + "A" + "F" + "C" + "G")
    # E: hand clears A, B; evicts C (hand -> D). F: D unvisited -> evicted.
    # C (miss): hand at E, unvisited -> E evicted. G: hand at F (unvisited) -> F evicted.
    assert evicted == ["C", "D", "E", "F"]
    assert cache.keys() == ["A", "B", "C", "G"]


def test_pop_keeps_the_hand_on_the_same_entry() -> None:
    cache: SieveCache[str, int] = SieveCache(3)
    fill(cache, "abc")
    cache.get("a")
    assert fill(cache, "d") == ["b"]  # hand: a cleared, b evicted, now at c
    assert cache.pop("a") == ord("a")  # an entry before the hand leaves
    assert cache.pop("zz") is None
    assert fill(cache, "e") == []  # room again
    assert fill(cache, "f") == ["c"]  # hand still on c


def test_replacing_a_value_counts_as_a_visit() -> None:
    cache: SieveCache[str, int] = SieveCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.put("a", 10) == []
    assert cache.put("c", 3) == [("b", 2)]
    assert cache.get("a") == 10
    assert len(cache) == 2 and "c" in cache


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SieveCache(0)
