"""The only place wall time is read. Policy code takes `now_s` as an argument instead."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_s(self) -> float:
        """Seconds on a monotonic clock."""
        ...


class SystemClock:
    def now_s(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock tests move by hand."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now_s(self) -> float:
        return self._now_s

    def advance(self, delta_s: float) -> None:
        if delta_s < 0:
            raise ValueError(f"a clock cannot go back: delta_s={delta_s}")
        self._now_s += delta_s
