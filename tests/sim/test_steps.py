"""Closed-form runs of steps whose durations grow linearly."""

from __future__ import annotations

import pytest

from kvcake.sim.steps import StepRun, plan_run


def test_run_arithmetic() -> None:
    run = StepRun(10.0, 4, 1.0, 0.5)  # steps last 1, 1.5, 2, 2.5
    assert run.elapsed_s(0) == 0.0
    assert run.elapsed_s(2) == 2.5
    assert run.end_s == 17.0
    assert [run.steps_done_by(t) for t in (10.0, 10.99, 11.0, 12.5, 16.99, 17.0, 99.0)] == \
        [0, 0, 1, 2, 3, 4, 4]
    assert run.truncated(2).end_s == 12.5
    with pytest.raises(ValueError):
        run.truncated(5)


def test_plan_run_keeps_an_affine_cost_whole() -> None:
    run = plan_run(0.0, 1000, lambda i: 0.01 + 0.001 * i)
    assert (run.num_steps, run.first_s) == (1000, 0.01)
    assert run.delta_s == pytest.approx(0.001)


def test_plan_run_splits_where_the_roofline_bends() -> None:
    # max(memory, compute): flat at 0.05 until step 40, then rising: not one straight line.
    run = plan_run(0.0, 100, lambda i: max(0.05, 0.001 * i + 0.01))
    assert run.num_steps < 100
    for i in range(run.num_steps):  # within the planned run the line is exact
        assert run.first_s + i * run.delta_s == pytest.approx(max(0.05, 0.001 * i + 0.01))
    with pytest.raises(ValueError):
        plan_run(0.0, 0, lambda i: 1.0)
