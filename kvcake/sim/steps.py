"""Runs of identical engine steps whose durations grow linearly: the simulator's fast path.

Between two changes of a batch (a join, a finish, a new prefill) every step of an instance has
the same shape: the same sequences, each one token longer than at the previous step. The cost
model's step time is affine in the context length (bytes read grow by a constant per step), so
step i of such a run lasts `first_s + i * delta_s` and the whole run is closed-form arithmetic:
the simulator schedules one event per run, not one per token. Where the cost model is not affine
over a run (the roofline switches from memory- to compute-bound inside it), the run is split at
the first step where the straight line stops matching and the rest is planned again later.

    start_s          step 0         step 1              step k-1
       |---- first ----|-- first+delta --|  ...  |-- first+(k-1)delta --|
                     token 1          token 2                         token k
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_REL_TOL = 1e-9


@dataclass(frozen=True, slots=True)
class StepRun:
    """`num_steps` steps from `start_s`; step i lasts `first_s + i * delta_s` seconds."""

    start_s: float
    num_steps: int
    first_s: float
    delta_s: float

    def elapsed_s(self, k: int) -> float:
        """Seconds taken by the first `k` steps."""
        return k * self.first_s + self.delta_s * k * (k - 1) / 2.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.elapsed_s(self.num_steps)

    def steps_done_by(self, time_s: float) -> int:
        """How many steps have finished by `time_s` (0..num_steps)."""
        lo, hi = 0, self.num_steps
        while lo < hi:  # largest k with start + elapsed(k) <= time_s
            mid = (lo + hi + 1) // 2
            if self.start_s + self.elapsed_s(mid) <= time_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def truncated(self, num_steps: int) -> StepRun:
        """The same run cut to its first `num_steps` steps."""
        if not 1 <= num_steps <= self.num_steps:
            raise ValueError(f"num_steps must be in 1..{self.num_steps}, got {num_steps}")
        return StepRun(self.start_s, num_steps, self.first_s, self.delta_s)


def plan_run(start_s: float, max_steps: int, step_s: Callable[[int], float]) -> StepRun:
    """The longest run of at most `max_steps` steps over which `step_s(i)` is a straight line.

    `step_s(i)` is the duration of step i. Checked at both ends and the middle; if the line
    does not hold there, the run is halved until it does (one step always does).
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    first = step_s(0)
    if max_steps == 1:
        return StepRun(start_s, 1, first, 0.0)
    delta = step_s(1) - first
    n = max_steps
    while n > 2:
        last, mid = n - 1, (n - 1) // 2
        if _close(step_s(last), first + last * delta) and _close(step_s(mid), first + mid * delta):
            break
        n //= 2
    return StepRun(start_s, n, first, delta)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b), 1e-12)
