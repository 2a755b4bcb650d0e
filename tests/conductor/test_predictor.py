"""Prefill-time regression and decode-step predictor: fit accuracy, errors, JSON round trip."""

from __future__ import annotations

import random

import pytest

from kvcake.conductor.cost import CostModel
from kvcake.conductor.predictor import (
    DecodePoint,
    DecodeStepPredictor,
    PrefillPoint,
    PrefillTimePredictor,
    profile_grid,
)


def test_degree_2_fit_reproduces_the_analytic_model() -> None:
    cost = CostModel.from_spec("llama3-70b@a800x8")
    predictor = PrefillTimePredictor.fit(profile_grid(cost, 131072))
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(2, 131072)
        p = rng.randrange(0, n)
        assert predictor.predict(n, p) == pytest.approx(cost.predict(n, p), rel=1e-6, abs=1e-6)


def test_fit_on_noisy_measurements_is_within_a_few_percent() -> None:
    cost = CostModel.from_spec("llama3-8b@a800x8")
    rng = random.Random(3)
    points = [PrefillPoint(pt.input_len, pt.prefix_len, pt.time_s * rng.uniform(0.97, 1.03))
              for pt in profile_grid(cost, 32768, num_lengths=16, num_prefix_fracs=6)]
    predictor = PrefillTimePredictor.fit(points)
    for n, p in [(32768, 0), (16000, 8000), (20000, 1000)]:
        assert predictor.predict(n, p) == pytest.approx(cost.predict(n, p), rel=0.05)


def test_too_few_points_is_a_clear_error() -> None:
    points = [PrefillPoint(100 * k, 0, 0.1 * k) for k in range(1, 5)]
    with pytest.raises(ValueError, match="at least 6 distinct"):
        PrefillTimePredictor.fit(points)
    # Enough points, but prefix never varies: the polynomial is not determined.
    flat = [PrefillPoint(100 * k, 0, 0.1 * k) for k in range(1, 10)]
    with pytest.raises(ValueError, match="vary both"):
        PrefillTimePredictor.fit(flat)
    with pytest.raises(ValueError, match="bad profile point"):
        PrefillTimePredictor.fit([PrefillPoint(10, 20, 1.0)] * 6)


def test_json_round_trip_and_bad_json() -> None:
    cost = CostModel.from_spec("llama3-8b@h800x8")
    predictor = PrefillTimePredictor.fit(profile_grid(cost, 8192), degree=3)
    again = PrefillTimePredictor.from_json(predictor.to_json())
    assert again.coeffs == predictor.coeffs and again.degree == 3
    assert again.predict(5000, 1000) == predictor.predict(5000, 1000)
    with pytest.raises(ValueError, match="prefill_poly"):
        PrefillTimePredictor.from_json('{"kind": "other"}')
    with pytest.raises(ValueError, match="coefficients"):
        PrefillTimePredictor(2, 1.0, [1.0, 2.0])


def test_predictions_are_never_negative() -> None:
    predictor = PrefillTimePredictor(1, 1.0, [-1.0, 0.0, 0.0])
    assert predictor.predict(10, 0) == 0.0


def test_decode_predictor_fits_the_roofline_memory_regime() -> None:
    cost = CostModel.from_spec("llama3-70b@a800x8")
    points = [DecodePoint(b, c, cost.decode_step_time_s(b, c))
              for b in (1, 8, 32, 64) for c in (b * 1000, b * 8000)]
    predictor = DecodeStepPredictor.fit(points)
    assert predictor.decode_step_time_s(48, 200_000) == pytest.approx(
        cost.decode_step_time_s(48, 200_000), rel=1e-6)
    assert predictor.decode_step_time_s(0, 0) == 0.0
    assert DecodeStepPredictor.from_json(predictor.to_json()).coeffs == predictor.coeffs
    with pytest.raises(ValueError, match="at least 3 distinct"):
        DecodeStepPredictor.fit(points[:2])
