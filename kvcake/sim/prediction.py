"""A prefill-time predictor that errs: the regression's answer times a seeded factor.

The Conductor's regression is fitted to the very cost model the simulator executes, so without
this its error is the fit's alone (small). Real predictors err; `NoisyPrefillModel` multiplies
every answer by a factor uniform in [1 - error, 1 + error], drawn once per (prompt length,
prefix length) from `seed`: the same question always gets the same answer (the Conductor's
`PrefillModel` contract: a pure function), and a run is reproducible.
"""

from __future__ import annotations

import random

from kvcake.conductor import PrefillModel


class NoisyPrefillModel:
    """`inner`'s prediction times a seeded factor in [1 - error, 1 + error]."""

    def __init__(self, inner: PrefillModel, error: float, seed: int = 0) -> None:
        if not 0 <= error < 1:
            raise ValueError(f"error must be in [0, 1) (0.1 = +-10%), got {error}")
        self.inner = inner
        self.error = error
        self.seed = seed

    def factor(self, input_len: int, prefix_len: int) -> float:
        rng = random.Random(f"{self.seed}:{input_len}:{prefix_len}")
        return 1.0 + self.error * (2.0 * rng.random() - 1.0)

    def predict(self, input_len: int, prefix_len: int) -> float:
        return self.inner.predict(input_len, prefix_len) * self.factor(input_len, prefix_len)
