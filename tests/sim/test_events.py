"""The event queue's total order: time, then kind priority, then push order."""

from __future__ import annotations

import pytest

from kvcake.sim.events import Event, EventKind, EventQueue


def _drain(queue: EventQueue) -> list[Event]:
    return [queue.pop() for _ in range(len(queue))]


def test_time_orders_first() -> None:
    q = EventQueue()
    q.push(Event(2.0, EventKind.FLOW_DONE, 0))
    q.push(Event(1.0, EventKind.ARRIVAL, 1))
    assert [e.time_s for e in _drain(q)] == [1.0, 2.0]


def test_same_time_orders_by_kind_not_by_push_order() -> None:
    q = EventQueue()
    q.push(Event(5.0, EventKind.ARRIVAL, 0))
    q.push(Event(5.0, EventKind.DECODE_STEP_DONE, 0))
    q.push(Event(5.0, EventKind.PREFILL_DONE, 0))
    q.push(Event(5.0, EventKind.FLOW_DONE, 0))
    kinds = [e.kind for e in _drain(q)]
    assert kinds == [EventKind.FLOW_DONE, EventKind.PREFILL_DONE, EventKind.DECODE_STEP_DONE,
                     EventKind.ARRIVAL]


def test_same_time_and_kind_keep_push_order() -> None:
    q = EventQueue()
    for target in (7, 3, 5):
        q.push(Event(1.0, EventKind.ARRIVAL, target))
    assert [e.target for e in _drain(q)] == [7, 3, 5]
    assert q.num_pushed == 3


def test_non_finite_time_is_refused_and_queue_still_works() -> None:
    q = EventQueue()
    with pytest.raises(ValueError, match="finite"):
        q.push(Event(float("nan"), EventKind.ARRIVAL, 0))
    with pytest.raises(ValueError, match="finite"):
        q.push(Event(float("inf"), EventKind.ARRIVAL, 0))
    q.push(Event(0.5, EventKind.ARRIVAL, 9))
    assert q.pop().target == 9
    with pytest.raises(IndexError):
        q.pop()
