"""Benchmark metrics on hand-computed gaps."""

from __future__ import annotations

import pytest

from kvcake.bench.stats import (
    Outcome,
    RequestResult,
    effective_shares,
    paper_tbt_s,
    summarize,
    tpot_s,
)


def test_paper_tbt_is_the_mean_of_the_slowest_tenth() -> None:
    assert paper_tbt_s([]) == 0.0
    assert paper_tbt_s([0.2]) == 0.2
    gaps = [0.01] * 18 + [0.5, 0.3]  # 20 gaps: slowest 2
    assert paper_tbt_s(gaps) == pytest.approx(0.4)
    assert paper_tbt_s([0.01] * 10 + [0.09]) == pytest.approx(0.05)  # 11 gaps: ceil -> 2


def result(ttft: float, gaps: list[float], prompt_len: int = 10) -> RequestResult:
    return RequestResult(Outcome.OK, prompt_len, output_len=len(gaps) + 1, ttft_s=ttft,
                         gaps_s=tuple(gaps), latency_s=ttft + sum(gaps))


def test_effective_shares_count_every_sent_request_at_each_tbt_slo() -> None:
    results = [result(1.0, [0.1, 0.1, 0.4]),  # TBT 0.4
               result(2.0, [0.05]),  # TBT 0.05
               result(40.0, [0.05]),  # TTFT miss at any TBT SLO
               RequestResult(Outcome.REJECTED, 10, error="HTTP 429")]  # a miss, counted
    assert effective_shares(results, 30.0, [0.01, 0.2, 0.5]) == [0.0, 0.25, 0.5]
    assert effective_shares([], 30.0, [0.1]) == [0.0]


def test_summary_fields_and_values() -> None:
    results = [
        result(1.0, [0.1, 0.1, 0.4]),  # TBT 0.4: misses a 0.2 s SLO
        result(2.0, [0.05]),  # effective
        result(40.0, [0.05]),  # TTFT miss
        RequestResult(Outcome.REJECTED, 10, error="HTTP 429"),
        RequestResult(Outcome.ERROR, 10, error="boom"),
    ]
    report = summarize(results, duration_s=10.0, ttft_slo_s=30.0, tbt_slo_s=0.2)
    assert (report["completed"], report["rejected"], report["errors"], report["failed"]) == (
        3, 1, 1, 2)
    assert report["total_input_tokens"] == 30
    assert report["total_output_tokens"] == 4 + 2 + 2
    assert report["request_throughput"] == pytest.approx(0.3)
    assert report["output_throughput"] == pytest.approx(0.8)
    assert report["num_effective_requests"] == 1
    assert report["effective_request_capacity"] == pytest.approx(0.2)  # 1 of 5 sent
    assert report["goodput"] == report["request_goodput"] == pytest.approx(0.1)
    assert report["mean_ttft_ms"] == pytest.approx(43000 / 3)
    assert report["median_ttft_ms"] == pytest.approx(2000)
    assert report["p99_ttft_ms"] == pytest.approx(2000 + 0.98 * 38000)  # linear interpolation
    # TPOT: (latency - ttft) / (out - 1) = 0.6/3, 0.05, 0.05
    assert report["mean_tpot_ms"] == pytest.approx(1000 * (0.2 + 0.05 + 0.05) / 3)
    # ITL pools all five gaps
    assert report["mean_itl_ms"] == pytest.approx(1000 * 0.7 / 5)
    assert report["median_itl_ms"] == pytest.approx(100)
    assert report["mean_tbt_ms"] == pytest.approx(1000 * (0.4 + 0.05 + 0.05) / 3)
    assert report["p90_tbt_ms"] == pytest.approx(50 + 0.8 * 350)
    assert report["error_messages"] == ["boom"]


def test_tpot_needs_two_tokens_and_empty_runs_report_zero() -> None:
    assert tpot_s(RequestResult(Outcome.OK, 1, output_len=1, ttft_s=0.1, latency_s=0.1)) is None
    report = summarize([RequestResult(Outcome.REJECTED, 5)], 1.0, 30.0, 0.1)
    assert report["mean_ttft_ms"] == 0.0 and report["effective_request_capacity"] == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0, 30.0, 0.1)
