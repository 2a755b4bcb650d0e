"""Pure: the order of repeated A/B runs (ABBA...) and the per-system medians and spreads.

Whichever system runs second on a small shared machine can look slower (the first one's memory
is still being handed back, caches differ); alternating the order and taking per-system medians
cancels that instead of hiding it in one run's ratio. No clock, process or I/O here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def alternating_orders(labels: Sequence[str], repeats: int) -> list[list[str]]:
    """Repeat i runs `labels` forwards when i is even, backwards when odd (AB BA AB BA ...).

    With two systems and an even `repeats` every system runs first and second equally often and
    each position's neighbours balance out (the ABBA design)."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"give each system once, got {list(labels)}")
    return [list(labels) if i % 2 == 0 else list(reversed(labels)) for i in range(repeats)]


@dataclass(frozen=True)
class Spread:
    """A metric over the repeats of one system: median, smallest, largest, how many."""

    median: float
    low: float
    high: float
    n: int

    @property
    def rel_spread(self) -> float:
        """(high - low) / median; 0 when the median is 0."""
        return (self.high - self.low) / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def lookup(result: Mapping[str, Any], path: str) -> float | None:
    """`result["a"]["b"]` for path "a.b" as a float; None when any part is missing or null."""
    value: Any = result
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return None if value is None else float(value)


def spread(runs: Sequence[Mapping[str, Any]], path: str) -> Spread | None:
    """`path` over the runs that measured it; None when none did."""
    values = [v for v in (lookup(r, path) for r in runs) if v is not None]
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def ratios(ours: Mapping[str, Any] | None, peer: Mapping[str, Any] | None,
           metrics: Sequence[tuple[str, str]]) -> dict[str, float | None]:
    """ours / peer per (key, path) of `metrics`, rounded to 4 places; None when either lacks it."""
    out: dict[str, float | None] = {}
    for key, path in metrics:
        mine = None if ours is None else lookup(ours, path)
        base = None if peer is None else lookup(peer, path)
        out[key] = None if mine is None or not base else round(mine / base, 4)
    return out


def median_result(runs: Sequence[Mapping[str, Any]], paths: Sequence[str]) -> dict[str, Any]:
    """A result of the same nested shape holding, per path, the median over `runs`."""
    out: dict[str, Any] = {}
    for path in paths:
        found = spread(runs, path)
        if found is None:
            continue
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = found.median
    return out


def position_effect(runs: Sequence[Mapping[str, Any]], label: str, path: str) -> dict[int, float]:
    """Median of `path` for system `label` by its position in the run order (0: ran first).

    `runs` are `{"order": [labels...], "results": {label: result}}`; a position no run measured
    is left out. With alternating orders this shows whether running second costs a system."""
    by_pos: dict[int, list[float]] = {}
    for run in runs:
        value = lookup(run["results"].get(label, {}), path)
        if value is not None and label in run["order"]:
            by_pos.setdefault(list(run["order"]).index(label), []).append(value)
    return {pos: statistics.median(vs) for pos, vs in sorted(by_pos.items())}
