"""The mean of live profiles measured at both ends of a live run (`kvcake simulate --live-profile`'s
JSON, kvcake/sim/live_profile.py).

A shared host's speed drifts: on one 2-core VM the same one-engine fit moved 9-14% within 20
minutes (docs/benchmarks.md, fifteenth session). A live run is best priced by the host over its
own stretch, and the profiles measured just before and just after it bracket that stretch: their
mean prices every prefill and decode step at the mean of the two measurements.

Every fitted model here is linear in its coefficients in a fixed basis (the prefill polynomial
in (input, prefix) / `scale`, the decode step model in batch and context), so the mean of two
fits' coefficients predicts the mean of their predictions; host factors and overheads are
averaged as they are. What fixes a basis or a shape (kinds, degrees, `scale`, shapes, token
counts: every string, integer and bool, and a float under a key in `BASIS_KEYS`) must be equal
in both, and both must have the same keys: a profile measured another way is refused by path.

Pure: no torch, no files.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BASIS_KEYS", "mean_profile"]

BASIS_KEYS = frozenset({"scale"})  # floats that fix a fit's basis: equal, never averaged


def mean_profile(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The live profile whose every measured number is the mean of `before`'s and `after`'s."""
    return _mean(before, after, "profile", basis=False)


def _mean(a: Any, b: Any, path: str, basis: bool) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            only = sorted(set(a) ^ set(b))
            raise ValueError(f"{path}: {only} in one profile only; measure both the same way")
        return {k: _mean(a[k], b[k], f"{path}.{k}", k in BASIS_KEYS) for k in a}
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise ValueError(f"{path}: {len(a)} values against {len(b)}; measure both on the "
                             "same grid")
        return [_mean(x, y, f"{path}[{i}]", basis) for i, (x, y) in enumerate(zip(a, b, strict=True))]
    if _is_measured(a, b) and not basis:
        return (a + b) / 2.0
    if type(a) is not type(b) or a != b:
        raise ValueError(f"{path}: {a!r} against {b!r}; these must be equal to average the "
                         "profiles")
    return a


def _is_measured(a: Any, b: Any) -> bool:
    """Two numbers, at least one a float: measured values, not counts or labels."""
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
    return numbers and (isinstance(a, float) or isinstance(b, float))
