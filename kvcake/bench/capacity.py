"""The highest replay speed at which a server still meets its SLOs (`--find-capacity`).

Pure search over a `probe(speed) -> share of effective requests` callable: double (or halve)
the speed from the start until the target share is crossed, then bisect geometrically between
the last passing and the first failing speed until they are within `rel_tol` of each other or
the probe budget is spent. Each probe is a full replay, so the budget is small; the search
assumes the share does not grow with speed (more load never helps latency).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class MultiProbe:
    speed: float
    shares: tuple[float, ...]  # effective share under each SLO, in the caller's order


@dataclass(frozen=True)
class MultiCapacityResult:
    best_speeds: tuple[float | None, ...]  # per SLO, as `CapacityResult.best_speed`
    probes: tuple[MultiProbe, ...]  # every distinct replay, in the order run


def find_capacities(probe: Callable[[float], Sequence[float]], start_speed: float,
                    num_slos: int, target: float = 0.9, max_probes: int = 4,
                    rel_tol: float = 0.1) -> MultiCapacityResult:
    """`find_capacity` for several SLOs from the same replays: one probe gives the share under
    every SLO (e.g. three TBT SLOs). SLO k's search starts at SLO k-1's capacity when there is
    one (a looser SLO never has less capacity, the caller orders them tightest first); a speed
    already replayed is not replayed again. At most `max_probes` lookups per SLO, so at most
    `num_slos * max_probes` replays in all."""
    if num_slos < 1:
        raise ValueError(f"num_slos must be >= 1, got {num_slos}")
    seen: dict[float, tuple[float, ...]] = {}
    order: list[MultiProbe] = []

    def shares(speed: float) -> tuple[float, ...]:
        if speed not in seen:
            got = tuple(float(s) for s in probe(speed))
            if len(got) != num_slos:
                raise ValueError(f"probe gave {len(got)} shares, expected {num_slos}")
            seen[speed] = got
            order.append(MultiProbe(speed, got))
        return seen[speed]

    best: list[float | None] = []
    start = start_speed
    for k in range(num_slos):
        def share_k(speed: float, k: int = k) -> float:
            return shares(speed)[k]

        found = find_capacity(share_k, start, target, max_probes, rel_tol)
        best.append(found.best_speed)
        if found.best_speed is not None:
            start = found.best_speed
    return MultiCapacityResult(tuple(best), tuple(order))
