"""Pure; how a prefill worker hands a request's KV to the decode worker: layer by layer during
the prefill, or all of it after.

Layer-wise streaming hides the transfer behind the next layers' compute but costs the prefill
its layer hook (a submission per layer and step on the engine thread, and the copies running
beside the compute on the same cores). It pays when the transfer is long next to that cost.
Measured on one 2-core host (shared memory, `serving_disagg_vs_colocated.py --transport`,
2026-12-01): a 2.94 MiB hand-off after the prefill exposed 1.3-3.2 ms, while the layer-wise
mode added ~5 ms of prefill compute in the interleaved runs (more in the sequential ones): not
a net win there. So each request streams layer-wise only when its KV would take at least
`min_transfer_s` to send after the prefill at the bandwidth the worker measured on its own
after-prefill hand-offs (an EWMA; the first request, and every `probe_every`-th one that would
stream layer-wise, is handed off after the prefill so the estimate follows the link).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAMPLE_BYTES = 256 * 1024  # smaller hand-offs time the call overhead, not the link


@dataclass
class HandoffPolicy:
    min_transfer_s: float = 0.010
    ewma_alpha: float = 0.3
    probe_every: int = 16
    bandwidth_bytes_per_s: float | None = None  # None: nothing measured yet
    _since_probe: int = 0

    def __post_init__(self) -> None:
        if not self.min_transfer_s >= 0 or not 0 < self.ewma_alpha <= 1 or self.probe_every < 1:
            raise ValueError("handoff policy: min_transfer_s >= 0, ewma_alpha in (0, 1], "
                             "probe_every >= 1")

    def layerwise(self, kv_bytes: int) -> bool:
        """Stream this request's `kv_bytes` layer by layer (True) or after its prefill."""
        if self.bandwidth_bytes_per_s is None:
            return False
        if kv_bytes / self.bandwidth_bytes_per_s < self.min_transfer_s:
            return False
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            return False  # measure the link again
        return True

    def observe(self, num_bytes: int, exposed_s: float) -> None:
        """An after-prefill hand-off of `num_bytes` took `exposed_s` seconds."""
        if num_bytes < MIN_SAMPLE_BYTES or not exposed_s > 0:
            return
        sample = num_bytes / exposed_s
        old = self.bandwidth_bytes_per_s
        self.bandwidth_bytes_per_s = sample if old is None else \
            old + self.ewma_alpha * (sample - old)
