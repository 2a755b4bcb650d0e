"""KVCache fetches as the Conductor plans them: where a fetch reads from, how long it takes, the
plan a placement carries, and the bytes of planned fetches still in flight from each source.

The time of a fetch is its bytes plus the backlog already planned from the same source, over
the loading speed (`BandwidthEstimator`: the configured prior, then measured transfers).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from kvcake.conductor.bandwidth import BandwidthEstimator
from kvcake.conductor.config import ConductorConfig
from kvcake.conductor.decision import FetchPlan, PrefillEstimate, ScheduleRequest
from kvcake.conductor.index import PrefixMatch


class Transfers:
    """Planned fetches and the loading speed. kv_bytes_per_token sizes them."""

    def __init__(self, config: ConductorConfig, kv_bytes_per_token: int) -> None:
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bytes_per_s = config.transfer_bandwidth_bytes_per_s  # what fetches are planned at
        self.bandwidth = BandwidthEstimator(config.transfer_bandwidth_bytes_per_s,
                                            config.measured_bandwidth_weight,
                                            config.min_measured_bytes)
        self.inflight_bytes: dict[str, int] = {}  # fetch source -> bytes planned, not done
        self._by_request: dict[str, tuple[str, int]] = {}  # request -> (source, bytes)

    def set_bandwidth(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.bandwidth.reset(bytes_per_s)
        self.bytes_per_s = bytes_per_s

    def observe(self, num_bytes: int, seconds: float) -> bool:
        """Fold one measured fetch into the loading speed. False: too small to count."""
        if not self.bandwidth.observe(num_bytes, seconds):
            return False
        self.bytes_per_s = self.bandwidth.bytes_per_s
        return True

    def source(self, match: PrefixMatch) -> str | None:
        """Of the holders of the longest prefix, the one whose link is least loaded: fewest
        bytes of planned fetches still in flight from it, then registration (pool) order."""
        holders = match.best_holders
        if len(holders) <= 1:
            return match.best_holder
        inflight = self.inflight_bytes
        return min(holders, key=lambda holder: inflight.get(holder, 0))

    def transfer_s(self, source: str, start_len: int, end_len: int) -> float:
        """Seconds to fetch tokens `start_len`..`end_len` from `source`, behind its backlog."""
        fetch_bytes = (end_len - start_len) * self.kv_bytes_per_token
        backlog = self.inflight_bytes.get(source, 0)
        return (backlog + fetch_bytes) / self.bytes_per_s

    def plan(self, req: ScheduleRequest, chosen: PrefillEstimate, local_blocks: int,
             source: str | None) -> FetchPlan | None:
        """The fetch the chosen prefill candidate needs (None: it recomputes what it lacks)."""
        if chosen.prefix_len <= chosen.local_len or source is None:
            return None
        last = -(-chosen.prefix_len // req.block_size)  # blocks covering the reused tokens
        keys = tuple(req.block_keys[local_blocks:last])
        num_bytes = (chosen.prefix_len - chosen.local_len) * self.kv_bytes_per_token
        return FetchPlan(source, keys, chosen.local_len, chosen.prefix_len, num_bytes,
                         chosen.transfer_s)

    def book(self, request_id: str, fetch: FetchPlan) -> None:
        self.inflight_bytes[fetch.source] = self.inflight_bytes.get(fetch.source, 0) + fetch.num_bytes
        self._by_request[request_id] = (fetch.source, fetch.num_bytes)

    def done(self, request_id: str) -> None:
        """The fetch of `request_id` completed, failed or was dropped (unknown ids: ignored)."""
        source, num_bytes = self._by_request.pop(request_id, ("", 0))
        if num_bytes:
            left = self.inflight_bytes.get(source, 0) - num_bytes
            if left > 0:
                self.inflight_bytes[source] = left
            else:
                self.inflight_bytes.pop(source, None)
