"""Decisions are pinned: a seeded workload must produce exactly the recorded decisions.

The record (`golden_decisions.txt`) was made before the decision-latency work; every speed-up
must leave each decision, its per-candidate breakdowns and the public load views bit-identical.
The replay is bit-stable on any x86-64 CPU: a fitted scenario runs on the predictors stored in
the record (numpy's fit is not bit-stable across OpenBLAS kernels), and the fresh fit is checked
against them at FIT_RTOL. See `golden_workload.py` for the workload and how to re-record.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcake.conductor import DecodeStepPredictor, PrefillTimePredictor
from tests.conductor.golden_workload import (
    FIT_RTOL,
    SCENARIOS,
    _Driver,
    canonical,
    first_difference,
    fit_mismatches,
    fit_predictors,
    parse_record,
)

GOLDEN = Path(__file__).with_name("golden_decisions.txt")
RECORDED = parse_record(GOLDEN.read_text())
FITTED = next(s for s in SCENARIOS if s.fitted)


def test_the_record_covers_every_scenario_and_kind_of_decision() -> None:
    assert sorted(RECORDED) == sorted(s.name for s in SCENARIOS)
    for s in SCENARIOS:
        assert (RECORDED[s.name].fit is not None) == s.fitted, s.name
    lines = [line for section in RECORDED.values() for line in section.lines]
    kinds = {line.split()[1] for line in lines if not line.startswith("@")}
    assert kinds == {"P", "R"}
    assert any(" ttft_slo " in line for line in lines) and any(" tbt_slo " in line for line in lines)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_decisions_match_the_record_exactly(scenario: object) -> None:
    section = RECORDED[scenario.name]  # type: ignore[attr-defined]
    got = list(_Driver(scenario, section.fit).run())  # type: ignore[arg-type]
    assert first_difference(section.lines, got) is None, \
        f"{scenario.name}: {first_difference(section.lines, got)}"  # type: ignore[attr-defined]


def test_this_machines_fit_is_the_recorded_fit() -> None:
    """The fit itself is pinned too, at FIT_RTOL (its last bits depend on the BLAS kernel)."""
    recorded = RECORDED[FITTED.name].fit
    assert recorded is not None
    assert fit_mismatches(recorded, fit_predictors()) == []


def _scaled(fit: tuple[PrefillTimePredictor, DecodeStepPredictor], factor: float
            ) -> tuple[PrefillTimePredictor, DecodeStepPredictor]:
    prefill, decode = fit
    return (PrefillTimePredictor(prefill.degree, prefill.scale, [c * factor for c in prefill.coeffs]),
            DecodeStepPredictor([c * factor for c in decode.coeffs]))


def test_the_fit_check_fails_beyond_its_tolerance_only() -> None:
    recorded = RECORDED[FITTED.name].fit
    assert recorded is not None
    assert fit_mismatches(recorded, _scaled(recorded, 1 + FIT_RTOL / 10)) == []
    beyond = fit_mismatches(recorded, _scaled(recorded, 1 + FIT_RTOL * 10))
    assert beyond and any(m.startswith("prefill(") for m in beyond) \
        and any(m.startswith("decode(") for m in beyond)


def test_the_record_fails_when_one_decision_changes() -> None:
    section = RECORDED[SCENARIOS[0].name]
    got = list(_Driver(SCENARIOS[0]).run())
    assert first_difference(section.lines, got) is None
    i = next(i for i, line in enumerate(got) if " P p" in line)
    rid, kind, prefill_id, *rest = got[i].split()
    other = "p1" if prefill_id != "p1" else "p2"
    changed = [*got[:i], " ".join([rid, kind, other, *rest]), *got[i + 1:]]
    assert first_difference(section.lines, changed) == \
        f"line {i}: got {changed[i]!r}, recorded {got[i]!r}"
    assert first_difference(section.lines, got[:-1]) is not None


def test_the_record_fails_when_the_replayed_fit_moves() -> None:
    """A fitted scenario replayed on a fit nudged by 1e-6 no longer matches: floats are seen."""
    section = RECORDED[FITTED.name]
    assert section.fit is not None
    got = list(_Driver(FITTED, _scaled(section.fit, 1 + 1e-6)).run())
    assert first_difference(section.lines, got) is not None


def test_canonical_form_sees_every_candidate_value() -> None:
    """A change to any one candidate value must change the digest (the record can fail)."""
    driver = _Driver(SCENARIOS[0])
    req = driver.request(0)
    decision = driver.c.schedule(req, 0.0)
    base = canonical(decision)
    first = decision.prefill_candidates[0]
    nudged = first._replace(queue_s=first.queue_s + 1e-12)
    changed = dataclasses.replace(decision,
                                  prefill_candidates=(nudged, *decision.prefill_candidates[1:]))
    assert canonical(changed) != base
