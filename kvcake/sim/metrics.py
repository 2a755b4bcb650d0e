"""Per-request latency bookkeeping and the summary, with the field's definitions (DESIGN.md 5).

- TTFT: arrival to first token (the end of the request's prefill).
- Token gaps: time between consecutive tokens of one request, the gap from the first to the
  second token included (it holds the KV hand-off and the wait to join a decode batch).
- MOONCAKE TBT of a request: the mean of its slowest 10% of token gaps (at least one gap); a
  request with a single output token has no gaps and no TBT, and meets any TBT SLO.
- Effective request: completed, TTFT <= TTFT SLO and TBT <= TBT SLO. Effective request capacity
  is the share of *all* requests (rejected ones included) that are effective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TBT_SLOWEST_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}


def stats(values: Sequence[float]) -> Stats:
    """Mean and percentiles (linear interpolation); all zeros for an empty sequence."""
    if not values:
        return Stats(0.0, 0.0, 0.0, 0.0)
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return Stats(float(arr.mean()), float(p50), float(p90), float(p99))


class GapLog:
    """The token gaps of one request, stored as runs: `count` gaps `first, first+delta, ...`.

    A decode run of k steps gives each member k gaps that grow linearly (see `steps.py`), so a
    request's few hundred gaps are a handful of runs.
    """

    __slots__ = ("runs", "num_gaps")

    def __init__(self) -> None:
        self.runs: list[tuple[int, float, float]] = []
        self.num_gaps = 0

    def add(self, count: int, first_s: float, delta_s: float = 0.0) -> None:
        if count > 0:
            self.runs.append((count, first_s, delta_s))
            self.num_gaps += count

    def gaps(self) -> np.ndarray:
        if not self.runs:
            return np.zeros(0)
        return np.concatenate(
            [first + delta * np.arange(count, dtype=np.float64) for count, first, delta in self.runs]
        )

    def tbt_s(self) -> float | None:
        """Mean of the slowest 10% of gaps (rounded up, at least one); None without gaps."""
        if self.num_gaps == 0:
            return None
        k = max(1, math.ceil(TBT_SLOWEST_SHARE * self.num_gaps))
        if len(self.runs) == 1 and self.runs[0][2] >= 0:  # one rising run: its last k gaps
            count, first, delta = self.runs[0]
            return first + delta * (count - 1 - (k - 1) / 2.0)
        gaps = self.gaps()
        return float(np.partition(gaps, gaps.size - k)[gaps.size - k :].mean())

    def max_gap_s(self) -> float | None:
        return float(self.gaps().max()) if self.num_gaps else None
