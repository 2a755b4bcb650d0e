"""Time predictors the Conductor consults, and fitted implementations of them.

`PrefillModel.predict(input_len, prefix_len)` and `DecodeModel.decode_step_time_s(batch_size,
context_tokens)` are the two questions the Conductor asks. `CostModel` answers both analytically;
`PrefillTimePredictor` (the paper's polynomial regression of input and prefix length) and
`DecodeStepPredictor` (linear in batch size and context tokens) answer them from profile points:
computed by the cost model in the simulator, measured on the engine in the live cluster.

Pure: numpy only, no torch, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class PrefillModel(Protocol):
    def predict(self, input_len: int, prefix_len: int) -> float:
        """Seconds to prefill `input_len` tokens of which the first `prefix_len` are cached.

        Must be a pure function of its arguments (the fitted predictors are immutable): the
        Conductor remembers answers."""
        ...


class DecodeModel(Protocol):
    def decode_step_time_s(self, batch_size: int, context_tokens: int) -> float:
        """Seconds of one decode step of `batch_size` sequences holding `context_tokens` in all.

        Must be a pure function of its arguments: the Conductor reuses an instance's last answer
        while its forecast batch is unchanged."""
        ...


@dataclass(frozen=True)
class PrefillPoint:
    """One profiled prefill: `input_len` tokens, `prefix_len` of them cached, took `time_s`."""

    input_len: int
    prefix_len: int
    time_s: float


@dataclass(frozen=True)
class DecodePoint:
    """One profiled decode step: `batch_size` sequences, `context_tokens` in all, took `time_s`."""

    batch_size: int
    context_tokens: int
    time_s: float


def _exponents(degree: int) -> list[tuple[int, int]]:
    return [(i, total - i) for total in range(degree + 1) for i in range(total, -1, -1)]


class PrefillTimePredictor:
    """Least-squares polynomial of total degree `degree` in (input_len, prefix_len).

    Degree 2 represents the analytic cost exactly: time is linear in (n - p) * n and (n - p).
    Lengths are divided by `scale` (the largest fitted input length) to keep the fit well
    conditioned. Immutable: `fit` returns a new predictor.
    """

    def __init__(self, degree: int, scale: float, coeffs: Sequence[float]) -> None:
        if degree < 1:
            raise ValueError(f"degree must be >= 1, got {degree}")
        if len(coeffs) != len(_exponents(degree)):
            raise ValueError(f"degree {degree} needs {len(_exponents(degree))} coefficients, "
                             f"got {len(coeffs)}")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.degree = degree
        self.scale = float(scale)
        self.coeffs = tuple(float(c) for c in coeffs)
        self._exps = _exponents(degree)

    @classmethod
    def fit(cls, points: Iterable[PrefillPoint], degree: int = 2) -> PrefillTimePredictor:
        """Fit on profile points; ValueError if there are too few (distinct) points for `degree`."""
        pts = list(points)
        exps = _exponents(degree)
        for p in pts:
            if not 0 <= p.prefix_len <= p.input_len or p.time_s < 0:
                raise ValueError(f"bad profile point {p}: need 0 <= prefix_len <= input_len, time_s >= 0")
        distinct = {(p.input_len, p.prefix_len) for p in pts}
        if len(distinct) < len(exps):
            raise ValueError(f"a degree-{degree} prefill predictor needs at least {len(exps)} "
                             f"distinct (input_len, prefix_len) points, got {len(distinct)}")
        scale = float(max(p.input_len for p in pts)) or 1.0
        n = np.array([p.input_len for p in pts], dtype=np.float64) / scale
        pre = np.array([p.prefix_len for p in pts], dtype=np.float64) / scale
        design = np.stack([n**i * pre**j for i, j in exps], axis=1)
        target = np.array([p.time_s for p in pts], dtype=np.float64)
        coeffs, _, rank, _ = np.linalg.lstsq(design, target, rcond=None)
        if rank < len(exps):
            raise ValueError(f"profile points do not determine a degree-{degree} polynomial "
                             f"(rank {rank} < {len(exps)}): vary both input_len and prefix_len")
        return cls(degree, scale, coeffs.tolist())

    def predict(self, input_len: int, prefix_len: int) -> float:
        """Predicted seconds, never negative."""
        n, p = input_len / self.scale, prefix_len / self.scale
        value = sum(c * n**i * p**j for c, (i, j) in zip(self.coeffs, self._exps, strict=True))
        return max(0.0, value)

    def to_json(self) -> str:
        return json.dumps({"kind": "prefill_poly", "degree": self.degree, "scale": self.scale,
                           "coeffs": list(self.coeffs)})

    @classmethod
    def from_json(cls, text: str) -> PrefillTimePredictor:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("kind") != "prefill_poly":
            raise ValueError("not a serialised PrefillTimePredictor (kind != 'prefill_poly')")
        return cls(int(data["degree"]), float(data["scale"]), [float(c) for c in data["coeffs"]])


class DecodeStepPredictor:
    """Least-squares t = c0 + c1 * batch_size + c2 * context_tokens (a memory-bound step)."""

    def __init__(self, coeffs: Sequence[float]) -> None:
        if len(coeffs) != 3:
            raise ValueError(f"DecodeStepPredictor needs 3 coefficients, got {len(coeffs)}")
        self.coeffs = tuple(float(c) for c in coeffs)

    @classmethod
    def fit(cls, points: Iterable[DecodePoint]) -> DecodeStepPredictor:
        pts = list(points)
        if len({(p.batch_size, p.context_tokens) for p in pts}) < 3:
            raise ValueError(f"a decode predictor needs at least 3 distinct (batch_size, "
                             f"context_tokens) points, got {len(pts)}")
        design = np.array([[1.0, p.batch_size, p.context_tokens] for p in pts])
        target = np.array([p.time_s for p in pts])
        coeffs, _, rank, _ = np.linalg.lstsq(design, target, rcond=None)
        if rank < 3:
            raise ValueError("decode profile points must vary batch_size and context_tokens "
                             "independently")
        return cls(coeffs.tolist())

    def decode_step_time_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size == 0:
            return 0.0
        c0, c1, c2 = self.coeffs
        return max(0.0, c0 + c1 * batch_size + c2 * context_tokens)

    def to_json(self) -> str:
        return json.dumps({"kind": "decode_linear", "coeffs": list(self.coeffs)})

    @classmethod
    def from_json(cls, text: str) -> DecodeStepPredictor:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("kind") != "decode_linear":
            raise ValueError("not a serialised DecodeStepPredictor (kind != 'decode_linear')")
        return cls([float(c) for c in data["coeffs"]])


def profile_grid(model: PrefillModel, max_input_len: int, num_lengths: int = 12,
                 num_prefix_fracs: int = 5) -> list[PrefillPoint]:
    """Profile points of `model` on a grid: input lengths up to `max_input_len` and prefix shares
    0, 1/(k-1), ..., 1 (prefix capped at input_len - 1). What the simulator fits its predictor on."""
    if max_input_len < 2 or num_lengths < 2 or num_prefix_fracs < 2:
        raise ValueError("profile_grid needs max_input_len >= 2, num_lengths >= 2, num_prefix_fracs >= 2")
    points: list[PrefillPoint] = []
    for k in range(1, num_lengths + 1):
        n = max(2, round(max_input_len * k / num_lengths))
        for j in range(num_prefix_fracs):
            p = min(n - 1, round(n * j / (num_prefix_fracs - 1)))
            points.append(PrefillPoint(n, p, model.predict(n, p)))
    return points
