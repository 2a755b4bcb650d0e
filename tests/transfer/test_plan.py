"""Slicing and striping arithmetic: which bytes go to which rail, exactly."""

from __future__ import annotations

import pytest

from kvcake.transfer import RailPreference, Slice, plan_slices, retry_rail
from kvcake.transfer.plan import cut, validate_preference


def test_cut_leaves_a_short_last_slice() -> None:
    assert cut(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert cut(8, 4) == [(0, 4), (4, 4)]
    assert cut(3, 4) == [(0, 3)]


def test_slices_stripe_round_robin_across_requests() -> None:
    both = RailPreference((0, 1))
    slices, cursor = plan_slices([(100, 10, both), (0, 4, both)], slice_bytes=4)
    assert slices == [
        Slice(0, 0, 100, 4, 0), Slice(0, 4, 104, 4, 1), Slice(0, 8, 108, 2, 0),
        Slice(1, 0, 0, 4, 1),
    ]
    assert cursor == 4


def test_cursor_carries_over_so_one_slice_batches_spread() -> None:
    pref = RailPreference((0, 1, 2))
    rails = []
    cursor = 0
    for _ in range(4):
        slices, cursor = plan_slices([(0, 4, pref)], slice_bytes=4, cursor=cursor)
        rails.append(slices[0].rail)
    assert rails == [0, 1, 2, 0]


def test_only_preferred_rails_carry_first_attempts() -> None:
    pref = RailPreference(preferred=(2, 3), secondary=(0,))
    slices, _ = plan_slices([(0, 16, pref)], slice_bytes=4)
    assert [s.rail for s in slices] == [2, 3, 2, 3]


def test_retries_walk_preferred_then_secondary_and_wrap() -> None:
    pref = RailPreference(preferred=(2, 3), secondary=(0,))
    assert [retry_rail(pref, 3, a) for a in (1, 2, 3)] == [0, 2, 3]
    assert [retry_rail(pref, 2, a) for a in (1, 2, 3)] == [3, 0, 2]
    alone = RailPreference((1,))
    assert retry_rail(alone, 1, 1) == 1


@pytest.mark.parametrize(("pref", "message"), [
    (RailPreference(()), "at least one preferred"),
    (RailPreference((0, 4)), r"rails \[4\] do not exist"),
    (RailPreference((0,), (0,)), "appears twice"),
])
def test_bad_preferences_are_refused(pref: RailPreference, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_preference(pref, num_rails=4)
