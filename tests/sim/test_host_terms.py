"""`benchmarks/host_terms.py`: the live profile's host terms measured from a tiny step trace
(decode steps, the prefill worker's CPU samples, one request) with exact expectations."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvcake.conductor import DecodePoint, DecodeStepPredictor, PrefillPoint, PrefillTimePredictor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import host_terms  # noqa: E402

DECODE = DecodeStepPredictor.fit([DecodePoint(b, c, 0.010) for b in (1, 4) for c in (64, 512)])
PREFILL = PrefillTimePredictor.fit([PrefillPoint(n, p, 1e-3 * (n - p))
                                    for n in (100, 200, 400, 800) for p in (0, n // 2, n // 4)])


def saved() -> dict[str, Any]:
    """Prefill worker busy (one core) over [1.00, 1.30) s, idle otherwise, sampled every 20 ms;
    decode steps (fit: 10 ms each) of 15 ms wall while it is idle, 25 ms while it computes,
    2 ms apart; one 150-token request sent at 0.99 s to the idle prefill worker."""
    cpu, used = [], 0.0
    for i in range(100):  # 0.00 .. 1.98 s
        t = round(0.02 * i, 2)
        cpu.append([t, {"prefill": used, "decode": 0.0}])
        used += 0.02 if 1.0 <= t < 1.3 else 0.0
    steps = []
    for start, end, wall in ((0.10, 0.90, 0.015), (1.02, 1.28, 0.025), (1.40, 1.90, 0.015)):
        t = start  # back-to-back steps 2 ms apart; the phases > 50 ms apart
        while t + wall <= end:
            steps.append({"t0": t, "t1": t + wall, "t2": t + wall + 0.001, "cpu": wall,
                          "rows": [["a", 100]]})
            t += wall + 0.002
    return {"steps": steps, "cpu": cpu, "rate": 1.0,
            "requests": [{"send_at_s": 0.99, "prompt_len": 150, "max_tokens": 4,
                          "ttft_s": 0.35, "gaps_s": []}]}


def test_host_terms_from_a_tiny_trace() -> None:
    terms = host_terms.measure(saved(), DECODE, PREFILL)
    assert terms["decode_step_overhead_s"] == pytest.approx(0.002)
    assert terms["contention"]["decode"] == pytest.approx(1.5)  # 15 ms over the 10 ms fit
    assert terms["contention"]["decode_prefill_busy"] == pytest.approx(2.5)  # 25 ms
    assert terms["contention"]["prefill"] == pytest.approx(0.30 / 0.150)  # busy 0.3 s, fit 150 ms
    assert terms["evidence"]["prefill_spans"] == 1
    # the decode worker stepped through that prefill: one class measured, no busy factor
    assert terms["evidence"]["prefill_spans_decode_idle_busy"] == [0, 1]
    assert terms["contention"]["prefill_decode_busy"] is None


def test_a_request_sent_to_a_busy_prefill_worker_is_not_a_span() -> None:
    data = saved()
    data["requests"][0]["send_at_s"] = 1.1  # inside the busy window: it queued
    terms = host_terms.measure(data, DECODE, PREFILL)
    assert terms["evidence"]["prefill_spans"] == 0
    assert terms["contention"]["prefill"] == 1.0


def test_the_terms_go_into_the_live_profile() -> None:
    profile = {"live": {"kv_pool_tokens": 1}, "decode": {}}
    terms = {"decode_step_overhead_s": 0.0012345678,
             "contention": {"decode": 1.25, "decode_prefill_busy": None, "prefill": 0.9}}
    out = host_terms.with_terms(profile, terms)
    assert out["live"] == {"kv_pool_tokens": 1, "decode_step_overhead_s": 0.001235,
                           "contention": {"decode": 1.25, "prefill": 0.9}}
    assert profile["live"] == {"kv_pool_tokens": 1}  # the input is left as it was


def test_the_step_dispersion_is_measured_around_each_class_factor() -> None:
    terms = host_terms.measure(saved(), DECODE, PREFILL)
    # every idle step is 1.5x the fit and every busy one 2.5x: no spread around the classes
    assert terms["step_jitter_quantiles"] == pytest.approx([1.0] * 99)


def test_jittered_tbts_multiply_each_gap_by_a_draw() -> None:
    from kvcake.sim.metrics import GapLog

    class State:
        def __init__(self, gaps: GapLog) -> None:
            self.gaps = gaps

    ten = GapLog()
    ten.add(10, 0.010)  # ten gaps of 10 ms: the slowest 10% is one gap
    states = [State(ten), State(GapLog())]
    assert host_terms.jittered_tbts(states, None) == [pytest.approx(0.010), None]
    assert host_terms.jittered_tbts(states, [3.0]) == [pytest.approx(0.030), None]
    draws = host_terms.jittered_tbts(states, [1.0, 2.0], seed=1)[0]
    assert draws == pytest.approx(0.020)  # ten draws of 1 or 2: the largest is 2 (seeded)
