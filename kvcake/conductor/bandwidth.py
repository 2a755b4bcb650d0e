"""The Conductor's KVCache loading speed, estimated from measured transfers.

`BandwidthEstimator` starts at a configured prior (`ConductorConfig.transfer_bandwidth_bytes_per_s`)
and follows the transfers the caller measures (bytes moved, seconds taken): the first measurement
replaces the prior (a guess, often a NIC's nominal speed), later ones are folded in as an
exponentially weighted moving average of bytes/s, so the estimate follows a link that slows
down or recovers within a few transfers. Transfers smaller than `min_bytes` are ignored: their
time is mostly latency, not bandwidth. One estimate for all links (the Conductor plans every
fetch at one speed).

Pure: no I/O, no clock (the seconds are measured by the caller).
"""

from __future__ import annotations

import math

__all__ = ["BandwidthEstimator"]


class BandwidthEstimator:
    """EWMA of measured transfer speeds, in bytes/s.

    prior_bytes_per_s: the estimate before any measurement. weight: the share of the newest
    measurement in the average, in (0, 1] (1: the last transfer alone). min_bytes: smaller
    transfers are not measurements.
    """

    def __init__(self, prior_bytes_per_s: float, weight: float = 0.5, min_bytes: int = 0) -> None:
        _check_speed(prior_bytes_per_s, "prior_bytes_per_s")
        if not (math.isfinite(weight) and 0.0 < weight <= 1.0):
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes!r}")
        self.weight = weight
        self.min_bytes = min_bytes
        self._bytes_per_s = float(prior_bytes_per_s)
        self._samples = 0

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    @property
    def num_samples(self) -> int:
        """Measurements folded in since the prior (or the last `reset`)."""
        return self._samples

    def reset(self, bytes_per_s: float) -> None:
        """Set the estimate (an operator's or a benchmark's value); it counts as the prior."""
        _check_speed(bytes_per_s, "bytes_per_s")
        self._bytes_per_s = float(bytes_per_s)
        self._samples = 0

    def observe(self, num_bytes: int, seconds: float) -> bool:
        """One measured transfer; False (and no change) when it is too small to count or took no
        measurable time."""
        if num_bytes < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a measured transfer needs num_bytes >= 0 and finite seconds >= 0, "
                             f"got {num_bytes!r} bytes in {seconds!r} s")
        if num_bytes == 0 or num_bytes < self.min_bytes or seconds == 0:
            return False
        speed = num_bytes / seconds
        if self._samples == 0:
            self._bytes_per_s = speed
        else:
            self._bytes_per_s += self.weight * (speed - self._bytes_per_s)
        self._samples += 1
        return True


def _check_speed(value: float, name: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
