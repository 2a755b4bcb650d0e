"""Per-instance load books: prefill queue time and the decode batch forecast."""

from __future__ import annotations

import math
import random

import pytest

from kvcake.conductor.load import DecodeLoad, PrefillQueue


def test_queue_time_sums_waiting_and_what_is_left_of_running() -> None:
    q = PrefillQueue()
    q.add("a", 2.0)
    q.add("b", 3.0)
    assert q.queue_s(0.0) == 5.0
    q.start("a", now_s=10.0)
    assert q.queue_s(10.5) == pytest.approx(4.5)
    assert q.queue_s(20.0) == 3.0  # an overdue prefill counts for nothing left
    q.remove("a")
    q.remove("a")  # duplicate report: harmless
    q.start("zzz", 1.0)  # unknown: harmless
    assert q.queue_s(20.0) == 3.0 and len(q) == 1 and "b" in q
    q.remove("b")
    assert q.queue_s(0.0) == 0.0 and len(q) == 0


def test_a_finished_prefill_teaches_its_instance_its_speed() -> None:
    q = PrefillQueue()
    q.add("a", 2.0)
    q.add("b", 3.0)
    q.start("a", now_s=10.0)
    q.finish("a", now_s=14.0, weight=0.0)  # weight 0: the fit as measured
    assert q.speed == 1.0 and q.queue_s(14.0) == 3.0
    q.add("c", 1.0)
    q.start("b", now_s=14.0)
    q.finish("b", now_s=20.0, weight=0.5)  # the first: 6 s for 3 fitted sets speed 2x
    assert q.speed == 2.0 and q.queue_s(20.0) == 2.0  # c: 1 s fitted, at 2x
    q.start("c", now_s=20.0)
    assert q.queue_s(21.5) == pytest.approx(0.5)  # 2 s predicted, 1.5 s gone
    q.finish("c", now_s=20.5, weight=0.5)  # 0.5 s for 1 s: means 3.25 / 2.0 s
    assert q.speed == pytest.approx(1.625) and len(q) == 0
    q.add("d", 2.0)
    q.finish("d", now_s=30.0, weight=0.5)  # never started: teaches nothing
    assert q.speed == pytest.approx(1.625) and len(q) == 0


def test_decode_forecast_drops_finished_and_adds_joined() -> None:
    d = DecodeLoad()
    d.expect("a", join_s=1.0, context_tokens=100, output_len=10)
    d.expect("b", join_s=5.0, context_tokens=200, output_len=10)
    assert d.batch_at(0.0) == (0, 0)
    assert d.batch_at(1.0) == (1, 100)
    assert d.batch_at(6.0) == (2, 300)
    seen: list[tuple[int, int]] = []

    def step(batch: int, context: int) -> float:
        seen.append((batch, context))
        return 0.5

    d.join("a", now_s=2.0, step_time_s=step)  # finishes at 2 + 10 * 0.5 = 7
    assert seen == [(1, 100)]  # the batch it joins: itself (b is not due before 5.0)
    assert d.batch_size == 1 and d.num_pending == 1 and d.num_booked == 2
    assert d.batch_at(6.9) == (2, 300)
    assert d.batch_at(7.0) == (1, 200)  # a has finished, b has joined
    assert d.next_finish_after(0.0) == 7.0 and d.next_finish_after(7.0) is None
    d.remove("a")
    d.remove("b")
    assert d.batch_at(100.0) == (0, 0) and "a" not in d and d.num_booked == 0


def test_expected_after_counts_what_is_dispatched_and_not_due_yet() -> None:
    d = DecodeLoad()
    assert d.expected_after(0.0) == (0, 0)
    d.expect("a", join_s=1.0, context_tokens=100, output_len=10)
    d.expect("b", join_s=5.0, context_tokens=200, output_len=10)
    d.expect("c", join_s=5.0, context_tokens=40, output_len=10)
    assert d.expected_after(0.0) == (3, 340)
    assert d.expected_after(1.0) == (2, 240)  # a is due (batch_now counts it), b and c not
    assert d.batch_now(1.0) == (1, 100)
    assert d.expected_after(5.0) == (0, 0)
    d.join("a", now_s=2.0, step_time_s=lambda batch, context: 0.5)
    assert d.expected_after(2.0) == (2, 240)  # joined: the batch's now, not expected
    d.remove("b")
    assert d.expected_after(2.0) == (1, 40)


def test_decode_forecast_under_t_d_counts_each_request_for_its_window() -> None:
    # Uniform t_d = 2 s: a joins at 0 (window to 2), b at 3 (to 5); c is due to join at 4.
    d = DecodeLoad()
    for rid, join_s, context in (("a", 0.0, 100), ("b", 3.0, 200), ("c", 4.0, 400)):
        d.expect(rid, join_s=join_s, context_tokens=context, output_len=10)
    d.join("a", now_s=0.0, step_time_s=lambda b, c: 1.0, decode_s=2.0)
    assert d.batch_window(0.0, 1.9) == (1, 100)
    d.join("b", now_s=3.0, step_time_s=lambda b, c: 1.0, decode_s=2.0)
    # At 3.5 a is reported decoding past its window: the forecast leaves it out.
    assert d.batch_now(3.5) == (2, 300)
    assert d.batch_window(3.5, 3.5) == (1, 200)
    assert d.batch_window(3.5, 4.0) == (2, 600)  # c joined
    d.remove("b")  # b reported finished early, at 3.6: it still counts to its window's end
    assert d.batch_window(3.6, 4.9) == (2, 600)
    assert d.batch_window(3.6, 5.0) == (1, 400)
    with pytest.raises(ValueError, match="before now_s"):
        d.batch_window(3.5, 3.0)


def test_decode_forecast_is_exact_after_every_change_and_at_every_boundary() -> None:
    """The forecast is reused between changes; it must answer as a fresh count would: at the
    finish and join times themselves, just before and after them, and after every report."""
    rng = random.Random(3)
    d = DecodeLoad()
    joined: dict[str, tuple[float, int]] = {}  # request -> (finish_s, context)
    pending: dict[str, tuple[float, int]] = {}  # request -> (join_s, context)
    output_lens: dict[str, int] = {}

    def expected(t: float) -> tuple[int, int]:
        live = [c for f, c in joined.values() if f > t] + [c for j, c in pending.values() if j <= t]
        return len(live), sum(live)

    for step in range(300):
        op = rng.random()
        if op < 0.4:
            rid, ctx = f"r{step}", rng.randrange(1, 50)
            join_s = rng.choice([1.0, 2.0, 2.5, rng.uniform(0.0, 10.0)])
            output_lens[rid] = rng.randrange(1, 5)
            d.expect(rid, join_s, ctx, output_lens[rid])
            pending[rid] = (join_s, ctx)
        elif op < 0.7 and pending:
            rid = rng.choice(sorted(pending))
            now_s = rng.uniform(0.0, 10.0)
            d.join(rid, now_s, lambda batch, context: 0.5)  # finishes output_len steps later
            joined[rid] = (now_s + output_lens[rid] * 0.5, pending.pop(rid)[1])
        elif joined or pending:
            rid = rng.choice(sorted(joined) + sorted(pending))
            d.remove(rid)
            joined.pop(rid, None)
            pending.pop(rid, None)
        times = [t for t, _ in joined.values()] + [t for t, _ in pending.values()]
        probes = [rng.uniform(-1.0, 12.0) for _ in range(3)]
        for t in times[:4]:
            probes += [t, math.nextafter(t, -math.inf), math.nextafter(t, math.inf)]
        for t in probes + probes[::-1]:  # twice: the second pass is served from the cache
            assert d.batch_at(t) == expected(t), (step, t)
