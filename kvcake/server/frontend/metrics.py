"""Serving metrics for /metrics: `prometheus_client` with one registry per server.

vLLM's names and labels under a `kvcake:` prefix, every family labelled with `model_name`:

- `kvcake:time_to_first_token_seconds`, `kvcake:inter_token_latency_seconds`,
  `kvcake:e2e_request_latency_seconds` (histograms), and ours, `kvcake:request_tbt_seconds`
  (MOONCAKE's per-request TBT: mean of its slowest 10% gaps); `kvcake:request_queue_time_seconds`
  and `kvcake:request_prefill_time_seconds` (vLLM's: engine arrival to the step that first
  schedules the request, that step's start to the first token), from backends that report them
  (`--mode single`'s in-process engine).
- `kvcake:request_success_total{finished_reason}`, `kvcake:prompt_tokens_total`,
  `kvcake:generation_tokens_total`, `kvcake:prefix_cache_queries_total` (prompt tokens looked
  up), `kvcake:prefix_cache_hits_total` (prompt tokens served from a prefix cache, local or the
  store).
- `kvcake:num_requests_waiting`, `kvcake:num_requests_running`, `kvcake:kv_cache_usage_perc`
  (gauges read from the backend's `stats()` at scrape time).
- Ours: `kvcake:request_rejected_total{reason}` (429s: the Conductor's reason, or the waiting
  limit), `kvcake:conductor_decisions_total{decision}` (placed | rejected),
  `kvcake:http_errors_total{status}`, `kvcake:kv_transfer_bytes_total`, and the cluster view of
  a disaggregated backend: `kvcake:kv_stream_hidden_share` (share of KV streaming hidden behind
  compute), `kvcake:store_fetched_tokens_total`, `kvcake:live_workers{role}`.

A registry per `ServerMetrics`, so that several servers in one process (tests) never share one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvcake.bench.stats import paper_tbt_s
from kvcake.server.frontend.backend import BackendStats, FinishReason

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                     0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
PREFIX = "kvcake:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RequestTimer:
    """Token timing of one request, fed by the API as events arrive (times from one clock)."""

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.gaps_s: list[float] = []
        self.queue_s: float | None = None  # the backend's, where it reports them (TokenEvent)
        self.prefill_s: float | None = None

    def on_tokens(self, now_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = now_s
        elif self.last_token_s is not None:
            self.gaps_s.append(now_s - self.last_token_s)
        self.last_token_s = now_s


class _BackendView(Collector):
    """Gauges and counters read from `BackendStats` at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = BackendStats()

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.stats, [self.model_name]

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_waiting", "Requests admitted, no first token yet.",
                    stats.num_waiting_requests)
        yield gauge("num_requests_running", "Requests being decoded.", stats.num_running_requests)
        yield gauge("kv_cache_usage_perc", "Share of KV pages in use (0..1).",
                    stats.kv_cache_usage)
        moved = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV bytes moved between "
                                    "instances and the store.", labels=["model_name"])
        moved.add_metric(labels, stats.transfer_bytes)
        yield moved
        extra = stats.extra
        if "kv_stream_hidden_share" in extra:
            yield gauge("kv_stream_hidden_share", "Share of layer-wise KV streaming hidden "
                        "behind prefill compute.", extra["kv_stream_hidden_share"])
        if "fetched_tokens" in extra:
            fetched = CounterMetricFamily(PREFIX + "store_fetched_tokens", "Prompt tokens whose "
                                          "KV was fetched from the store.", labels=["model_name"])
            fetched.add_metric(labels, extra["fetched_tokens"])
            yield fetched
        roles = {k[len("live_"):-len("_workers")]: v for k, v in extra.items()
                 if k.startswith("live_") and k.endswith("_workers") and k != "live_workers"}
        if roles:
            live = GaugeMetricFamily(PREFIX + "live_workers", "Workers alive, by role.",
                                     labels=["model_name", "role"])
            for role, count in sorted(roles.items()):
                live.add_metric([self.model_name, role], count)
            yield live


class ServerMetrics:
    """All metrics of one server, in its own registry; thread-safe (prometheus_client is)."""

    def __init__(self, model_name: str = "kvcake") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(PREFIX + name, help_text, m, registry=r, buckets=LATENCY_BUCKETS_S)

        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, help_text, [*m, *labels], registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between consecutive token events of a request.")
        self.request_tbt = histogram("request_tbt_seconds",
                                     "MOONCAKE TBT: mean of a request's slowest 10% of gaps.")
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to last token.")
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Engine arrival to the step that first scheduled the request "
                                    "(in-process engine only).")
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "That step's start to the first token (in-process engine "
                                      "only).")
        self.success = counter("request_success_total", "Finished requests by reason.",
                               ("finished_reason",))
        self.rejected = counter("request_rejected_total", "Requests refused with HTTP 429.",
                                ("reason",))
        self.decisions = counter("conductor_decisions_total", "Admission decisions.",
                                 ("decision",))
        self.http_errors = counter("http_errors_total", "Error responses by status.",
                                   ("status",))
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.cache_queries = counter("prefix_cache_queries_total",
                                     "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits_total",
                                  "Prompt tokens served from a prefix cache (local or store).")
        self._view = _BackendView(model_name)
        r.register(self._view)
        self._lock = threading.Lock()  # one scrape at a time sees one stats snapshot

    def on_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.cache_queries.labels(self.model_name).inc(num_prompt_tokens)
        self.decisions.labels(self.model_name, "placed").inc()

    def on_finished(self, timer: RequestTimer, end_s: float, num_cached_tokens: int,
                    num_generated: int, reason: FinishReason) -> None:
        name = self.model_name
        self.success.labels(name, reason.value).inc()
        self.generation_tokens.labels(name).inc(num_generated)
        self.cache_hits.labels(name).inc(num_cached_tokens)
        if timer.first_token_s is not None:
            self.ttft.labels(name).observe(timer.first_token_s - timer.arrival_s)
            for gap in timer.gaps_s:
                self.itl.labels(name).observe(gap)
            self.request_tbt.labels(name).observe(paper_tbt_s(timer.gaps_s))
        if timer.queue_s is not None and timer.prefill_s is not None:
            self.queue_time.labels(name).observe(timer.queue_s)
            self.prefill_time.labels(name).observe(timer.prefill_s)
        self.e2e.labels(name).observe(end_s - timer.arrival_s)

    def on_rejected(self, reason: str = "rejected") -> None:
        self.rejected.labels(self.model_name, reason).inc()
        self.decisions.labels(self.model_name, "rejected").inc()

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self, stats: BackendStats) -> str:
        with self._lock:
            self._view.stats = stats
            return generate_latest(self.registry).decode()
