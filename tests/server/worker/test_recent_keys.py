"""`RecentKeys`: the keys a store writer handed over, the oldest forgotten past the limit."""

from __future__ import annotations

import pytest

from kvcake.server.worker.recent_keys import RecentKeys


def test_the_oldest_keys_are_forgotten_past_the_limit() -> None:
    keys = RecentKeys(limit=3)
    keys.add([5, 6])
    keys.add([7, 8])
    assert len(keys) == 3 and 5 not in keys and [k in keys for k in (6, 7, 8)] == [True] * 3


def test_a_failed_put_forgets_its_keys() -> None:
    keys = RecentKeys(limit=10)
    keys.add([1, 2, 3])
    keys.forget([2, 9])  # 9 was never there: nothing to do
    assert [k in keys for k in (1, 2, 3)] == [True, False, True]


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="limit: at least 1 key, got 0"):
        RecentKeys(limit=0)
