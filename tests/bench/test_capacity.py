"""The capacity search over replay speed."""

from __future__ import annotations

import pytest

from kvcake.bench.capacity import find_capacity


def share_with_knee(knee: float):  # type: ignore[no-untyped-def]
    return lambda speed: 1.0 if speed <= knee else 0.5


def test_grows_then_bisects_to_the_knee() -> None:
    result = find_capacity(share_with_knee(5.0), start_speed=1.0, max_probes=20, rel_tol=0.01)
    assert [p.speed for p in result.probes[:4]] == [1.0, 2.0, 4.0, 8.0]
    assert result.best_speed is not None
    assert 5.0 / 1.01 <= result.best_speed <= 5.0
    assert all((p.share >= 0.9) == (p.speed <= 5.0) for p in result.probes)


def test_shrinks_when_the_start_fails_and_respects_the_budget() -> None:
    result = find_capacity(share_with_knee(0.3), start_speed=1.0, max_probes=3)
    assert [p.speed for p in result.probes] == [1.0, 0.5, 0.25]
    assert result.best_speed == 0.25
    nothing = find_capacity(lambda speed: 0.0, start_speed=1.0, max_probes=4)
    assert nothing.best_speed is None and len(nothing.probes) == 4


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--speed"):
        find_capacity(lambda s: 1.0, start_speed=0)
    with pytest.raises(ValueError, match="target"):
        find_capacity(lambda s: 1.0, start_speed=1, target=1.5)
