"""Serving metrics in the Prometheus text exposition format (version 0.0.4), for /metrics.

Written here rather than with `prometheus_client` so that every server in a test process gets
its own registry and nothing is global. Families (all prefixed `kvcake_`):

- `time_to_first_token_seconds` (histogram): request arrival -> first token leaves the backend.
- `time_between_tokens_seconds` (histogram): every gap between consecutive token events.
- `request_tbt_seconds` (histogram): MOONCAKE's per-request TBT (mean of its slowest 10% gaps).
- `e2e_request_latency_seconds` (histogram).
- `requests_total{finish_reason}`, `rejected_requests_total`, `http_errors_total{status}`.
- `prompt_tokens_total`, `generation_tokens_total`, `prefix_cache_queries_total` (prompt tokens
  looked up), `prefix_cache_hits_total` (prompt tokens served from cache) and their ratio
  `prefix_cache_hit_rate` (gauge).
- From the backend's `stats()`: `num_requests_waiting`, `num_requests_running`,
  `kv_cache_usage_ratio` (gauges) and `transfer_bytes_total` (zero on the colocated path).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from kvcake.bench.stats import paper_tbt_s
from kvcake.server.frontend.backend import BackendStats, FinishReason

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                     0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
PREFIX = "kvcake_"


class Histogram:
    """Cumulative-bucket histogram; `observe` is O(log buckets)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram {name}: buckets must be strictly increasing")
        self.name, self.help_text, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def render(self) -> list[str]:
        name = PREFIX + self.name
        lines = [f"# HELP {name} {self.help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{name}_sum {self.total!r}", f"{name}_count {cumulative}"]
        return lines


def _family(name: str, kind: str, help_text: str, samples: dict[str, float]) -> list[str]:
    full = PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{labels} {_number(value)}" for labels, value in samples.items()]
    return lines


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class RequestTimer:
    """Token timing of one request, fed by the API as events arrive (times from one clock)."""

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.gaps_s: list[float] = []

    def on_tokens(self, now_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = now_s
        elif self.last_token_s is not None:
            self.gaps_s.append(now_s - self.last_token_s)
        self.last_token_s = now_s


class ServerMetrics:
    """All counters of one server; thread-safe (the API and a backend thread may both write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("time_to_first_token_seconds",
                              "Request arrival to first token.", LATENCY_BUCKETS_S)
        self.tbt = Histogram("time_between_tokens_seconds",
                             "Gap between consecutive token events of a request.",
                             LATENCY_BUCKETS_S)
        self.request_tbt = Histogram("request_tbt_seconds",
                                     "MOONCAKE TBT: mean of a request's slowest 10% of gaps.",
                                     LATENCY_BUCKETS_S)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request arrival to last token.",
                             LATENCY_BUCKETS_S)
        self.finished: dict[str, int] = {}
        self.http_errors: dict[int, int] = {}
        self.num_rejected = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_cached_tokens = 0

    def on_admitted(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.num_prompt_tokens += num_prompt_tokens

    def on_finished(self, timer: RequestTimer, end_s: float, num_cached_tokens: int,
                    num_generated: int, reason: FinishReason) -> None:
        with self._lock:
            self.finished[reason.value] = self.finished.get(reason.value, 0) + 1
            self.num_generation_tokens += num_generated
            self.num_cached_tokens += num_cached_tokens
            if timer.first_token_s is not None:
                self.ttft.observe(timer.first_token_s - timer.arrival_s)
                for gap in timer.gaps_s:
                    self.tbt.observe(gap)
                self.request_tbt.observe(paper_tbt_s(timer.gaps_s))
            self.e2e.observe(end_s - timer.arrival_s)

    def on_rejected(self) -> None:
        with self._lock:
            self.num_rejected += 1

    def on_http_error(self, status: int) -> None:
        with self._lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self, stats: BackendStats) -> str:
        with self._lock:
            lines: list[str] = []
            for hist in (self.ttft, self.tbt, self.request_tbt, self.e2e):
                lines += hist.render()
            lines += _family("requests_total", "counter", "Finished requests by reason.",
                             {f'{{finish_reason="{k}"}}': v for k, v in
                              sorted(self.finished.items())})
            lines += _family("rejected_requests_total", "counter",
                             "Requests refused with HTTP 429.", {"": self.num_rejected})
            lines += _family("http_errors_total", "counter", "Error responses by status.",
                             {f'{{status="{k}"}}': v for k, v in sorted(self.http_errors.items())})
            queries, hits = self.num_prompt_tokens, self.num_cached_tokens
            for name, help_text, value in (
                ("prompt_tokens_total", "Prompt tokens admitted.", queries),
                ("generation_tokens_total", "Tokens generated.", self.num_generation_tokens),
                ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                 queries),
                ("prefix_cache_hits_total", "Prompt tokens served from the prefix cache.", hits),
            ):
                lines += _family(name, "counter", help_text, {"": value})
        gauges = (
            ("prefix_cache_hit_rate", "Share of prompt tokens served from cache.",
             hits / queries if queries else 0.0),
            ("num_requests_waiting", "Requests admitted, not yet prefilled.",
             stats.num_waiting_requests),
            ("num_requests_running", "Requests being decoded.", stats.num_running_requests),
            ("kv_cache_usage_ratio", "Share of KV pages in use.", stats.kv_cache_usage),
        )
        for name, help_text, gauge in gauges:
            lines += _family(name, "gauge", help_text, {"": gauge})
        lines += _family("transfer_bytes_total", "counter",
                         "KV bytes moved between instances and the store.",
                         {"": stats.transfer_bytes})
        return "\n".join(lines) + "\n"
