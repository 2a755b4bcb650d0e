"""/metrics through prometheus_client: vLLM's names under `kvcake:`, a registry per server,
parsed back with prometheus_client's parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcake.server.frontend.backend import BackendStats, FinishReason
from kvcake.server.frontend.metrics import RequestTimer, ServerMetrics
from tests.server.prom import value


def _observed() -> ServerMetrics:
    metrics = ServerMetrics("m")
    timer = RequestTimer(arrival_s=10.0)
    for now_s in (10.5, 10.6, 10.8, 11.2):  # gaps 0.1, 0.2, 0.4
        timer.on_tokens(now_s)
    metrics.on_admitted(100)
    metrics.on_finished(timer, 11.2, num_cached_tokens=64, num_generated=4,
                        reason=FinishReason.LENGTH)
    metrics.on_rejected("ttft_slo")
    return metrics


def test_vllm_names_and_labels_parse() -> None:
    stats = BackendStats(num_waiting_requests=2, transfer_bytes=5,
                         extra={"kv_stream_hidden_share": 0.75, "fetched_tokens": 32.0,
                                "live_prefill_workers": 2.0, "live_decode_workers": 1.0,
                                "live_workers": 3.0})
    text = _observed().render(stats)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"kvcake:time_to_first_token_seconds", "kvcake:request_success",
            "kvcake:prefix_cache_hits", "kvcake:prefix_cache_queries",
            "kvcake:inter_token_latency_seconds", "kvcake:e2e_request_latency_seconds",
            "kvcake:num_requests_waiting", "kvcake:kv_cache_usage_perc",
            "kvcake:live_workers", "kvcake:kv_stream_hidden_share",
            "kvcake:store_fetched_tokens", "kvcake:request_rejected",
            "kvcake:conductor_decisions"} <= names
    assert value(text, "kvcake:time_to_first_token_seconds_sum", model_name="m") == \
        pytest.approx(0.5)
    assert value(text, "kvcake:inter_token_latency_seconds_count") == 3
    assert value(text, "kvcake:request_tbt_seconds_sum") == pytest.approx(0.4)  # slowest gap
    assert value(text, "kvcake:request_success_total", finished_reason="length",
                 model_name="m") == 1
    assert value(text, "kvcake:prefix_cache_hits_total") == 64
    assert value(text, "kvcake:prefix_cache_queries_total") == 100
    assert value(text, "kvcake:num_requests_waiting", model_name="m") == 2
    assert value(text, "kvcake:kv_transfer_bytes_total") == 5
    assert value(text, "kvcake:live_workers", role="prefill") == 2
    assert value(text, "kvcake:live_workers", role="decode") == 1
    assert value(text, "kvcake:live_workers") == 3  # by role only: no role="" total
    assert value(text, "kvcake:store_fetched_tokens_total") == 32
    assert value(text, "kvcake:request_rejected_total", reason="ttft_slo") == 1
    assert value(text, "kvcake:conductor_decisions_total", decision="placed") == 1
    assert value(text, "kvcake:conductor_decisions_total", decision="rejected") == 1


def test_each_server_has_its_own_registry() -> None:
    first, second = _observed(), ServerMetrics("m")
    assert value(second.render(BackendStats()), "kvcake:request_success_total") == 0
    assert value(first.render(BackendStats()), "kvcake:request_success_total") == 1


def test_queue_and_prefill_times_come_from_the_backend_only() -> None:
    metrics = ServerMetrics("m")
    reported = RequestTimer(arrival_s=1.0)
    reported.on_tokens(1.3)
    reported.queue_s, reported.prefill_s = 0.05, 0.25
    silent = RequestTimer(arrival_s=2.0)  # a backend that does not report them
    silent.on_tokens(2.4)
    for timer in (reported, silent):
        metrics.on_finished(timer, 3.0, num_cached_tokens=0, num_generated=1,
                            reason=FinishReason.LENGTH)
    text = metrics.render(BackendStats())
    assert value(text, "kvcake:request_queue_time_seconds_count", model_name="m") == 1
    assert value(text, "kvcake:request_queue_time_seconds_sum") == pytest.approx(0.05)
    assert value(text, "kvcake:request_prefill_time_seconds_sum") == pytest.approx(0.25)
    assert value(text, "kvcake:time_to_first_token_seconds_count") == 2
