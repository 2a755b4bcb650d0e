"""GlobalIndex: add, remove, holders, and per-holder longest contiguous prefix."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcake.conductor.index import GlobalIndex


def test_match_gives_each_holders_contiguous_prefix_and_the_best() -> None:
    index = GlobalIndex()
    index.add("p0", [1, 2, 3])
    index.add("p1", [1, 2, 3, 4, 5])
    index.add("store", [1, 2, 3, 4, 5, 6])
    index.add("p2", [2, 3, 4])  # lacks the first key: no prefix at all
    m = index.match([1, 2, 3, 4, 5, 6, 7])
    assert m.blocks_by_holder == {"p0": 3, "p1": 5, "store": 6}
    assert (m.best_blocks, m.best_holder) == (6, "store")
    assert m.blocks("p2") == 0


def test_a_gap_ends_the_match_even_if_later_keys_are_held() -> None:
    index = GlobalIndex()
    index.add("p0", [1, 2, 4])
    assert index.match([1, 2, 3, 4]).blocks("p0") == 2


def test_ties_go_to_the_holder_registered_first() -> None:
    index = GlobalIndex()
    index.add_holder("p1")
    index.add("p0", [1, 2])
    index.add("p1", [1, 2])
    assert index.match([1, 2, 9]).best_holder == "p1"


def test_empty_and_unknown_keys() -> None:
    index = GlobalIndex()
    assert index.match([]).best_holder is None
    index.add("p0", [1])
    m = index.match([5, 1])
    assert (m.best_blocks, m.best_holder, m.blocks_by_holder) == (0, None, {})


def test_remove_is_idempotent_and_forgets_empty_keys() -> None:
    index = GlobalIndex()
    index.add("p0", [1, 2, 3])
    index.add("p1", [1, 2])
    index.remove("p0", [3, 3, 99])
    index.remove("nobody", [1])
    assert index.match([1, 2, 3]).blocks_by_holder == {"p0": 2, "p1": 2}
    assert len(index) == 2 and index.num_keys("p0") == 2
    index.remove("p1", [1, 2])
    assert index.holders_of(1) == ["p0"]


def test_remove_holder_frees_its_bit_for_a_new_holder() -> None:
    index = GlobalIndex()
    index.add("p0", [1, 2])
    index.add("p1", [1])
    index.remove_holder("p0")
    assert index.holders == ["p1"] and index.holders_of(2) == [] and len(index) == 1
    index.add("p2", [1, 2])  # reuses p0's bit: must not inherit p0's keys
    assert index.match([1, 2]).blocks_by_holder == {"p1": 1, "p2": 2}
    assert index.holders_of(1) == ["p2", "p1"]  # by bit order


def test_keys_are_opaque_hashables() -> None:
    index = GlobalIndex()
    index.add("p0", ["a", ("b", 1)])
    assert index.match(["a", ("b", 1), "c"]).blocks("p0") == 2


_ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "drop"]), st.sampled_from(["p0", "p1", "p2", "s"]),
              st.lists(st.integers(0, 9), max_size=6)),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(ops=_ops, query=st.lists(st.integers(0, 9), max_size=8))
def test_match_agrees_with_a_naive_model(ops: list[tuple[str, str, list[int]]],
                                         query: list[int]) -> None:
    index = GlobalIndex()
    model: dict[str, set[int]] = {}  # holder -> its keys
    for op, holder, keys in ops:
        if op == "add":
            index.add(holder, keys)
            model.setdefault(holder, set()).update(keys)
        elif op == "remove":
            index.remove(holder, keys)
            if holder in model:
                model[holder].difference_update(keys)
        else:
            index.remove_holder(holder)
            model.pop(holder, None)
    expected: dict[str, int] = {}
    for holder, held in model.items():
        n = 0
        while n < len(query) and query[n] in held:
            n += 1
        if n:
            expected[holder] = n
    m = index.match(query)
    assert m.blocks_by_holder == expected
    assert m.best_blocks == max(expected.values(), default=0)
    if expected:
        assert m.best_holder is not None and expected[m.best_holder] == m.best_blocks
    else:
        assert m.best_holder is None
    for holder in model:
        assert index.num_keys(holder) == len(model[holder])


def test_match_with_more_holders_than_a_machine_word_keeps_order_and_ties() -> None:
    """70 holders (multi-word bitmasks): every holder's prefix, in (blocks, registration) order."""
    rng = random.Random(5)
    index = GlobalIndex()
    holders = [f"h{i}" for i in range(70)]
    for holder in holders:
        index.add_holder(holder)
    query = list(range(40))
    model: dict[str, set[int]] = {}
    for holder in holders:
        held = set(query[: rng.choice([0, 3, 3, 17, 17, 40])]) | set(rng.sample(query, 5))
        index.add(holder, sorted(held))
        model[holder] = held
    expected = []
    for slot, holder in enumerate(holders):
        n = 0
        while n < len(query) and query[n] in model[holder]:
            n += 1
        if n:
            expected.append((n, slot, holder))
    m = index.match(query)
    assert list(m.blocks_by_holder.items()) == [(h, n) for n, _, h in sorted(expected)]
    best = max(expected)[0]
    assert (m.best_blocks, m.best_holder) == (best, min((s, h) for n, s, h in expected
                                                         if n == best)[1])
