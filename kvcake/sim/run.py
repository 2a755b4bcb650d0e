"""One simulated run end to end: a trace and a config in, the summary and the records out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcake.conductor import CostModel
from kvcake.sim.cluster import Cluster
from kvcake.sim.config import SimConfig
from kvcake.sim.records import Arrival, RequestState
from kvcake.sim.trace import Trace


@dataclass(frozen=True)
class SimResult:
    summary: dict[str, Any]
    states: list[RequestState]


def arrivals_of(trace: Trace, speed: float = 1.0, max_requests: int | None = None) -> list[Arrival]:
    """The trace's requests as arrivals, time divided by `speed`, optionally only the first ones."""
    if trace.block_size <= 0:
        raise ValueError(f"trace block_size must be > 0, got {trace.block_size}")
    requests = trace.requests if max_requests is None else trace.requests[:max_requests]
    start_ms = requests[0].timestamp_ms if requests else 0.0
    return [
        Arrival((r.timestamp_ms - start_ms) / 1000.0 / speed, r.input_len, r.output_len,
                r.hash_ids)
        for r in requests
    ]


def simulate(config: SimConfig, trace: Trace, cost: CostModel | None = None) -> SimResult:
    """Run `trace` on the cluster `config` describes. Deterministic for a given seed. `cost`
    replaces the profile's cost model (`kvcake simulate --live-profile`)."""
    if trace.block_size != config.block_size:
        raise ValueError(f"the trace has {trace.block_size}-token blocks but block_size is "
                         f"{config.block_size}; load the trace with the same block size")
    cluster = Cluster(config, arrivals_of(trace, config.speed, config.max_requests), cost)
    summary = cluster.run()
    summary["speed"] = config.speed
    return SimResult(summary, cluster.states)
