"""The store master's metrics for Prometheus (`prometheus_client` collector, read at scrape time).

`kvcake:store_nodes`, `kvcake:store_objects`, `kvcake:store_used_bytes`,
`kvcake:store_capacity_bytes`, `kvcake:store_disk_used_bytes` (gauges) and
`kvcake:store_evictions_total`, `kvcake:store_demotions_total`,
`kvcake:store_disk_evictions_total` (counters), from `MasterService.stats()`. Registered in the
frontend's registry when the master runs there (`kvcake serve`), or served alone by
`kvcake store master --metrics-port`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_GAUGES = (("num_nodes", "store_nodes", "Store nodes registered with the master."),
           ("num_objects", "store_objects", "Committed objects (KV blocks) in the store."),
           ("used_bytes", "store_used_bytes", "DRAM bytes the store's objects take."),
           ("capacity_bytes", "store_capacity_bytes", "DRAM bytes the store nodes give."),
           ("disk_used_bytes", "store_disk_used_bytes", "SSD-tier bytes in use."))
_COUNTERS = (("num_evicted", "store_evictions", "Objects evicted from DRAM."),
             ("num_demoted", "store_demotions", "Objects demoted from DRAM to disk."),
             ("num_disk_evicted", "store_disk_evictions", "Objects dropped from disk."))


class StoreMasterCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats  # MasterService.stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, name, help_text in _GAUGES:
            yield GaugeMetricFamily("kvcake:" + name, help_text, value=stats.get(key, 0))
        for key, name, help_text in _COUNTERS:
            yield CounterMetricFamily("kvcake:" + name, help_text, value=stats.get(key, 0))
