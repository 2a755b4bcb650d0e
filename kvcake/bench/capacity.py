"""The highest replay speed at which a server still meets its SLOs (`--find-capacity`).

Pure search over a `probe(speed) -> share of effective requests` callable: double (or halve)
the speed from the start until the target share is crossed, then bisect geometrically between
the last passing and the first failing speed until they are within `rel_tol` of each other or
the probe budget is spent. Each probe is a full replay, so the budget is small; the search
assumes the share does not grow with speed (more load never helps latency).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    speed: float
    share: float  # effective request capacity measured at this speed


@dataclass(frozen=True)
class CapacityResult:
    best_speed: float | None  # highest passing speed found; None if even the slowest failed
    probes: tuple[Probe, ...]


def find_capacity(probe: Callable[[float], float], start_speed: float, target: float = 0.9,
                  max_probes: int = 8, rel_tol: float = 0.1) -> CapacityResult:
    if not start_speed > 0:
        raise ValueError(f"--speed must be > 0 to start the capacity search, got {start_speed}")
    if not 0 < target <= 1:
        raise ValueError(f"target share must be in (0, 1], got {target}")
    if max_probes < 1:
        raise ValueError(f"max_probes must be >= 1, got {max_probes}")
    probes: list[Probe] = []

    def run(speed: float) -> bool:
        probes.append(Probe(speed, probe(speed)))
        return probes[-1].share >= target

    passing: float | None = None
    failing: float | None = None
    speed = start_speed
    while len(probes) < max_probes and (passing is None or failing is None):
        if run(speed):
            passing = speed
            speed *= 2
        else:
            failing = speed
            speed /= 2
        if passing is not None and failing is not None:
            break
    while (passing is not None and failing is not None and len(probes) < max_probes
           and failing / passing > 1 + rel_tol):
        middle = math.sqrt(passing * failing)
        if run(middle):
            passing = middle
        else:
            failing = middle
    return CapacityResult(passing, tuple(probes))
