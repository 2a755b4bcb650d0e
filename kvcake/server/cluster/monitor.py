"""Frontend housekeeping: liveness of the workers and the audit of store blocks.

`MonitorConfig` is the `[monitor]` section of a cluster file. `Monitor` is one daemon thread
that calls the backend's `check_workers()` every `ping_interval_s` and `audit_store()` every
`store_audit_interval_s`; both are plain methods, so tests call them directly with a manual
clock. The thread only paces; every decision is in those methods.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MonitorConfig:
    # A worker that has not answered a ping for this long is failed like a dead one. The
    # engine loop answers between steps, so this must exceed the longest engine step.
    worker_timeout_s: float = 30.0
    ping_interval_s: float = 1.0
    # Store audit: every interval, ask the master whether up to max_keys of the blocks the
    # Conductor lists under holder "store" still exist (round robin; 0 turns it off).
    store_audit_interval_s: float = 1.0
    store_audit_max_keys: int = 2048

    def __post_init__(self) -> None:
        for name in ("worker_timeout_s", "ping_interval_s", "store_audit_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"monitor.{name}: must be a number > 0, got {value!r}")
        if self.ping_interval_s >= self.worker_timeout_s:
            raise ValueError(f"monitor.ping_interval_s: must be below worker_timeout_s "
                             f"({self.worker_timeout_s}), got {self.ping_interval_s}")
        if not isinstance(self.store_audit_max_keys, int) or self.store_audit_max_keys < 0:
            raise ValueError(f"monitor.store_audit_max_keys: must be an integer >= 0, got "
                             f"{self.store_audit_max_keys!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MonitorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"[monitor]: unknown keys {unknown}; known keys are "
                             f"{sorted(known)}")
        return cls(**data)


class Monitor:
    """Paces `check_workers` and `audit_store`; `start()` / `close()`."""

    def __init__(self, config: MonitorConfig, check_workers: Callable[[], object],
                 audit_store: Callable[[], object] | None, name: str = "frontend-monitor") -> None:
        self.config = config
        self._check_workers, self._audit_store = check_workers, audit_store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        cfg = self.config
        tick_s = min(cfg.ping_interval_s, cfg.store_audit_interval_s)
        since_audit_s = 0.0
        while not self._stop.wait(tick_s):
            try:
                self._check_workers()
                since_audit_s += tick_s
                if self._audit_store is not None and since_audit_s >= cfg.store_audit_interval_s:
                    since_audit_s = 0.0
                    self._audit_store()
            except Exception:  # housekeeping must outlive one bad round
                log.exception("frontend monitor round failed")
