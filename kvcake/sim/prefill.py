"""A simulated prefill instance: a FIFO queue, one prefill at a time, a local LRU prefix cache.

Lifecycle of a request on it:

    (prefix fetched, if planned)  ->  enqueue  ->  running (prefill_s)  ->  done: first token

The cache holds this node's prefix blocks (its DRAM, the paper's "local prefix cache"): blocks
it computed and blocks it fetched. The cluster inserts them and reports evictions to the
Conductor's index. Passive state: the cluster calls `enqueue` / `on_done` and schedules the
events they return.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvcake.sim.cache import BlockLRU
from kvcake.sim.events import Event, EventKind


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """A prefill to run; `group`: the instances of a CPP pipeline (the same item is queued on
    each, and starts only when it heads every member's queue and all are idle)."""

    req: int
    prefill_s: float
    group: tuple[int, ...] = ()


class PrefillInstance:
    """One prefill instance (one node): FIFO queue and a local prefix cache."""

    def __init__(self, index: int, cache_blocks: int) -> None:
        self.index = index
        self.cache = BlockLRU(cache_blocks)
        self.queue: deque[QueuedPrefill] = deque()
        self.running: QueuedPrefill | None = None
        self.running_since_s = 0.0
        self.busy_s = 0.0
        # a live profile's shared host: a prefill takes this many times its queued time when it
        # starts (the host's decode worker busy or not then); None: as queued
        self.slowdown_at_start: Callable[[], float] | None = None

    def enqueue(self, now_s: float, item: QueuedPrefill) -> Event | None:
        """Queue a prefill whose prefix is local; returns its PREFILL_DONE if it starts now."""
        if item.prefill_s < 0:
            raise ValueError(f"prefill_s must be >= 0, got {item.prefill_s}")
        self.queue.append(item)
        return self._start(now_s) if self.running is None else None

    def on_done(self, now_s: float) -> tuple[QueuedPrefill, Event | None]:
        """The running prefill finished; returns it and the next one's PREFILL_DONE, if any."""
        if self.running is None:
            raise RuntimeError(f"prefill instance {self.index} finished while idle")
        done, self.running = self.running, None
        self.busy_s += done.prefill_s
        return done, self._start(now_s)

    @property
    def started(self) -> QueuedPrefill | None:
        """The prefill that the last `_start` began (the cluster reports it to the Conductor)."""
        return self.running

    def ready_for(self, item: QueuedPrefill) -> bool:
        """Idle with `item` at the head of the queue (a CPP prefill waits for all members)."""
        return self.running is None and bool(self.queue) and self.queue[0] is item

    def start_gang(self, now_s: float) -> Event:
        """Start the CPP prefill at the head of the queue (the cluster checked every member)."""
        if not self.queue or not self.queue[0].group or self.running is not None:
            raise RuntimeError(f"prefill instance {self.index} has no CPP prefill ready to start")
        return self._run_head(now_s)

    def _start(self, now_s: float) -> Event | None:
        if not self.queue or self.queue[0].group:
            return None  # a CPP prefill starts when its whole group is free (start_gang)
        return self._run_head(now_s)

    def _run_head(self, now_s: float) -> Event:
        self.running = self.queue.popleft()
        if self.slowdown_at_start is not None and not self.running.group:
            self.running = replace(self.running,
                                   prefill_s=self.running.prefill_s * self.slowdown_at_start())
        self.running_since_s = now_s
        return Event(now_s + self.running.prefill_s, EventKind.PREFILL_DONE, self.index)
