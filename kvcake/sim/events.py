"""Simulator events and the queue that orders them.

Events have an explicit total order: `(time_s, kind priority, seq)`. Two events at the same
instant run in the order of their kinds (completions free resources before arrivals look at
them), and only then in the order they were pushed. `seq` is assigned by the queue, so the order
is a pure function of the inputs: the same trace and seed give the same run, event for event.

Handlers never mutate the queue directly: they return follow-up events (see `loop.py`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import IntEnum


class EventKind(IntEnum):
    """Kinds of event; the value is the priority among events at the same instant (lower first).

    Completions come first so that resources they free are visible to everything else that
    happens at that instant; arrivals come last so the Conductor sees the settled state.
    """

    FLOW_DONE = 0  # a network flow (prefix fetch or KV hand-off) may have finished
    PREFILL_DONE = 1  # a prefill instance finished its running request
    DECODE_STEP_DONE = 2  # a decode (or colocated) instance reached a step boundary
    ARRIVAL = 3  # a request arrives at the Conductor


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happens at `time_s` to `target` (an instance index or a request index).

    `token` lets an owner cancel a scheduled event without searching the heap: the owner keeps
    the token it expects and ignores an event that carries an older one.
    """

    time_s: float
    kind: EventKind
    target: int
    token: int = 0


class EventQueue:
    """Min-heap of events in the order `(time_s, kind, seq)`."""

    def __init__(self) -> None:
        # Plain tuples: compared in C, and seq is unique so `event` itself is never compared.
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0

    def push(self, event: Event) -> None:
        if event.time_s != event.time_s or event.time_s == float("inf"):
            raise ValueError(f"event time must be finite, got {event.time_s} for {event}")
        heapq.heappush(self._heap, (event.time_s, int(event.kind), self._seq, event))
        self._seq += 1

    def pop(self) -> Event:
        """The earliest event. Raises IndexError when empty."""
        return heapq.heappop(self._heap)[3]

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def num_pushed(self) -> int:
        return self._seq
