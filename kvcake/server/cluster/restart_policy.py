"""When to restart a worker process that died, and when to stop: pure policy, no clock read.

`RestartBook.on_death(worker_id, now_s)` is told each death (the process reaped) and answers
the delay before the next start: `backoff_s`, doubled for each earlier death still inside
`window_s`, at most `max_backoff_s`. More than `max_restarts` deaths inside `window_s` is a
crash loop: `CrashLoop`, an error that says what to look at, and no more restarts of that worker.
A worker that stays up `window_s` starts again from `backoff_s`.

The `Supervisor` (supervisor.py, run by the launcher's `Cluster`) owns the processes: it reaps
them, unlinks a dead worker's shared memory, tells the backend (`DisaggBackend.worker_dead`),
asks this book, starts the replacement under the same worker id and hands it to the backend
(`add_worker`), which puts it back in the Conductor; its store node registers again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["CrashLoop", "RestartBook", "RestartPolicy"]


@dataclass(frozen=True)
class RestartPolicy:
    """Restarts of dead worker processes (`kvcake serve`)."""

    enabled: bool = True
    backoff_s: float = 0.5  # delay before the first restart
    max_backoff_s: float = 10.0
    max_restarts: int = 5  # deaths inside window_s beyond this: a crash loop, no more restarts
    window_s: float = 60.0
    # A worker declared lost (hung: its pings unanswered) while its process lives is killed
    # and replaced after this long (it may come back first: SIGCONT, a long GC pause).
    hung_grace_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("backoff_s", "max_backoff_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"restart.{name}: must be > 0, got {getattr(self, name)}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"restart.max_backoff_s: must be >= backoff_s ({self.backoff_s}), "
                             f"got {self.max_backoff_s}")
        if self.max_restarts < 0:
            raise ValueError(f"restart.max_restarts: must be >= 0, got {self.max_restarts}")
        if self.hung_grace_s < 0:
            raise ValueError(f"restart.hung_grace_s: must be >= 0, got {self.hung_grace_s}")


class CrashLoop(RuntimeError):
    """A worker died more than `max_restarts` times inside `window_s`: not restarted again."""


class RestartBook:
    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._deaths: dict[str, deque[float]] = {}
        self.given_up: dict[str, str] = {}  # worker id -> the CrashLoop message

    def on_death(self, worker_id: str, now_s: float, why: str = "exited") -> float:
        """Seconds to wait before starting `worker_id` again; CrashLoop when it must not be."""
        if worker_id in self.given_up:
            raise CrashLoop(self.given_up[worker_id])
        p = self.policy
        deaths = self._deaths.setdefault(worker_id, deque())
        while deaths and now_s - deaths[0] > p.window_s:
            deaths.popleft()
        deaths.append(now_s)
        if not p.enabled or len(deaths) > p.max_restarts:
            message = (f"worker {worker_id} {why}; it died {len(deaths)} times in "
                       f"{p.window_s:g} s (limit {p.max_restarts}): not restarting it (a crash "
                       "loop). Read its stderr, fix the cause and restart kvcake serve"
                       if p.enabled else f"worker {worker_id} {why}; restarts are off")
            self.given_up[worker_id] = message
            raise CrashLoop(message)
        return min(p.max_backoff_s, p.backoff_s * 2 ** (len(deaths) - 1))

    def deaths_in_window(self, worker_id: str) -> int:
        return len(self._deaths.get(worker_id, ()))
