"""A worker's own /metrics (`prometheus_client`, its own registry and HTTP server).

Read at scrape time from the worker's last load report and its prefix-cache event counts, all
labelled `model_name`, `worker_id` and `role`: `kvcake:num_requests_waiting`,
`kvcake:num_requests_running`, `kvcake:kv_cache_usage_perc` (gauges),
`kvcake:kv_blocks_stored_total`, `kvcake:kv_blocks_removed_total` (prefix-cache stores and
evictions). `--metrics-port` (0: any port, logged) turns it on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


@dataclass
class WorkerCounts:
    """What the engine loop updates (plain ints: a scrape reads them from another thread)."""

    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    num_blocks: int = 1
    blocks_stored: int = 0
    blocks_removed: int = 0


class WorkerCollector(Collector):
    def __init__(self, counts: WorkerCounts, labels: dict[str, str]) -> None:
        self.counts, self.labels = counts, labels

    def collect(self) -> Iterator[Metric]:
        c, names, values = self.counts, list(self.labels), list(self.labels.values())

        def family(kind: Callable[..., Metric], name: str, help_text: str,
                   value: float) -> Metric:
            metric = kind("kvcake:" + name, help_text, labels=names)
            metric.add_metric(values, value)  # type: ignore[attr-defined]
            return metric

        yield family(GaugeMetricFamily, "num_requests_waiting",
                     "Requests queued on this worker.", c.waiting)
        yield family(GaugeMetricFamily, "num_requests_running",
                     "Requests in this worker's batch.", c.running)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Share of KV blocks in use.",
                     1.0 - c.free_blocks / max(1, c.num_blocks))
        yield family(CounterMetricFamily, "kv_blocks_stored", "Blocks added to the prefix "
                     "cache.", c.blocks_stored)
        yield family(CounterMetricFamily, "kv_blocks_removed", "Blocks evicted from the "
                     "prefix cache.", c.blocks_removed)


def serve_metrics(collector: Collector, host: str, port: int) -> tuple[object, int]:
    """An HTTP server for the collector's /metrics on its own thread: (server, its port)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    server, _thread = start_http_server(port, host, registry)
    return server, int(server.server_port)
