"""TBT per the paper (mean of the slowest 10% of gaps) and summary statistics."""

from __future__ import annotations

import pytest

from kvcake.sim.metrics import GapLog, stats


def test_tbt_is_the_mean_of_the_slowest_tenth() -> None:
    log = GapLog()
    log.add(18, 0.01)  # 18 gaps of 10 ms
    log.add(1, 0.5)  # one stall
    log.add(1, 0.1)
    # 20 gaps -> slowest 2: 0.5 and 0.1
    assert log.num_gaps == 20
    assert log.tbt_s() == pytest.approx(0.3)
    assert log.max_gap_s() == pytest.approx(0.5)


def test_tbt_of_one_rising_run_is_closed_form() -> None:
    log = GapLog()
    log.add(10, 1.0, 1.0)  # gaps 1..10; slowest 10% rounded up = 1 gap
    assert log.tbt_s() == 10.0
    log2 = GapLog()
    log2.add(11, 1.0, 1.0)  # 11 gaps -> ceil(1.1) = 2 slowest: 11 and 10
    assert log2.tbt_s() == 10.5
    assert GapLog().tbt_s() is None


def test_stats() -> None:
    s = stats([1.0, 2.0, 3.0, 4.0])
    assert (s.mean, s.p50) == (2.5, 2.5)
    assert s.p90 == pytest.approx(3.7)
    assert stats([]).to_dict() == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
