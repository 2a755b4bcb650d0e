"""Prometheus exposition and the API's incremental detokenizer."""

from __future__ import annotations

import pytest

from kvcake.server.frontend.api import TextStream
from kvcake.server.frontend.backend import BackendStats, FinishReason
from kvcake.server.frontend.metrics import Histogram, RequestTimer, ServerMetrics


def test_histogram_buckets_are_cumulative() -> None:
    hist = Histogram("x_seconds", "x", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    assert hist.render()[2:] == [
        'kvcake_x_seconds_bucket{le="0.1"} 2',  # le: the bound is inclusive
        'kvcake_x_seconds_bucket{le="1.0"} 3',
        'kvcake_x_seconds_bucket{le="+Inf"} 4',
        "kvcake_x_seconds_sum 3.65",
        "kvcake_x_seconds_count 4",
    ]
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram("y", "y", (1.0, 0.5))


def test_request_timing_and_hit_rate() -> None:
    metrics = ServerMetrics()
    timer = RequestTimer(arrival_s=10.0)
    for now_s in (10.5, 10.6, 10.8, 11.2):  # gaps 0.1, 0.2, 0.4
        timer.on_tokens(now_s)
    metrics.on_admitted(100)
    metrics.on_finished(timer, 11.2, num_cached_tokens=64, num_generated=4,
                        reason=FinishReason.LENGTH)
    lines = metrics.render(BackendStats(num_waiting_requests=2, transfer_bytes=5)).splitlines()
    assert "kvcake_time_to_first_token_seconds_sum 0.5" in lines
    assert "kvcake_time_between_tokens_seconds_count 3" in lines
    tbt_sum = next(line for line in lines if line.startswith("kvcake_request_tbt_seconds_sum"))
    assert float(tbt_sum.split()[1]) == pytest.approx(0.4)  # 3 gaps: the slowest one
    assert 'kvcake_requests_total{finish_reason="length"} 1' in lines
    assert "kvcake_prefix_cache_hit_rate 0.64" in lines
    assert "kvcake_num_requests_waiting 2" in lines
    assert "kvcake_transfer_bytes_total 5" in lines


def test_text_stream_holds_back_split_characters() -> None:
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    euro = "€".encode()  # three bytes
    assert stream.push((ord("a"),), final=False) == "a"
    assert stream.push((euro[0],), final=False) == ""
    assert stream.push((euro[1],), final=False) == ""
    assert stream.push((euro[2],), final=False) == "€"
    assert stream.push((0xFF,), final=True) == "\ufffd"  # invalid byte: flushed at the end
