"""The single-mode engine loop hands a step's token events to the request loops with one
wake-up per loop (not one per request), in step order; a closed loop is skipped."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from kvcake.server.frontend.backend import GenerateRequest, TokenEvent
from kvcake.server.frontend.local_backend import _Add, _post_all
from kvcake.types import RequestId


class RecordingLoop:
    """Stands in for an event loop: records call_soon_threadsafe, runs the callbacks on run()."""

    def __init__(self, closed: bool = False) -> None:
        self.closed = closed
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((fn, args))

    def run(self) -> None:
        for fn, args in self.calls:
            fn(*args)


def _add(loop: RecordingLoop, rid: str) -> _Add:
    request = GenerateRequest(RequestId(rid), (1, 2), max_tokens=4)
    return _Add(request, asyncio.Queue(), loop, concurrent.futures.Future())  # type: ignore[arg-type]


def test_one_wake_up_per_loop_and_every_event_in_order() -> None:
    one, other, closed = RecordingLoop(), RecordingLoop(), RecordingLoop(closed=True)
    a, b, c, gone = _add(one, "a"), _add(one, "b"), _add(other, "c"), _add(closed, "d")
    events = [TokenEvent((i,)) for i in range(5)]
    _post_all([(a, events[0]), (b, events[1]), (gone, events[2]), (c, events[3]),
               (a, events[4])])
    assert len(one.calls) == 1 and len(other.calls) == 1
    one.run()
    other.run()
    assert [a.sink.get_nowait(), a.sink.get_nowait()] == [events[0], events[4]]
    assert b.sink.get_nowait() == events[1] and c.sink.get_nowait() == events[3]
    assert gone.sink.empty()

