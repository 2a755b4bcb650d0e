"""Decisions are pinned: a seeded workload must produce exactly the recorded decisions.

The record (`golden_decisions.txt`) was made before the decision-latency work; every speed-up
must leave each decision, its per-candidate breakdowns and the public load views bit-identical.
See `golden_workload.py` for what the workload exercises and how to re-record.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.conductor.golden_workload import SCENARIOS, _Driver, canonical

GOLDEN = Path(__file__).with_name("golden_decisions.txt")


def _recorded() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in GOLDEN.read_text().splitlines():
        if line.startswith("# "):
            current = sections.setdefault(line[2:], [])
        else:
            current.append(line)
    return sections


RECORDED = _recorded()


def test_the_record_covers_every_scenario_and_kind_of_decision() -> None:
    assert sorted(RECORDED) == sorted(s.name for s in SCENARIOS)
    lines = [line for section in RECORDED.values() for line in section]
    kinds = {line.split()[1] for line in lines if not line.startswith("@")}
    assert kinds == {"P", "R"}
    assert any(" ttft_slo " in line for line in lines) and any(" tbt_slo " in line for line in lines)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_decisions_match_the_record_exactly(scenario: object) -> None:
    expected = RECORDED[scenario.name]  # type: ignore[attr-defined]
    got = list(_Driver(scenario).run())  # type: ignore[arg-type]
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"first difference at line {i} of {scenario.name}"  # type: ignore[attr-defined]
    assert len(got) == len(expected)


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
