"""Continuous batching arithmetic of one decode instance, with a toy linear step cost."""

from __future__ import annotations

import pytest

from kvcake.sim.decode import DecodeInstance, Seq, StepCosts
from kvcake.sim.events import EventKind


def _costs() -> StepCosts:
    # step = 10 ms + 1 us per context token; prefill = 1 ms per new token
    return StepCosts(lambda batch, ctx: 0.010 + 1e-6 * ctx if batch else 0.0,
                     lambda n, p: 0.001 * (n - p))


def _seq(req: int, context: int, remaining: int, now: float = 0.0) -> Seq:
    return Seq(req, context, remaining, context + remaining + 1, last_token_s=now)


def test_one_event_per_run_until_the_first_member_finishes() -> None:
    inst = DecodeInstance(0, _costs(), max_kv_tokens=10_000, max_batch_size=4)
    ev = inst.add(0.0, _seq(0, 1000, 3))
    assert ev is not None and ev.kind is EventKind.DECODE_STEP_DONE
    # 3 steps: context 1000, 1001, 1002 -> 11 ms + 11.001 + 11.002
    assert ev.time_s == pytest.approx(0.033003)
    first, done, nxt = inst.on_step_done(ev.time_s, ev.token)
    assert first == [] and [s.req for s in done] == [0] and nxt is None
    assert done[0].gaps.num_gaps == 3
    assert inst.reserved_tokens == 0


def test_a_join_cuts_the_run_at_the_next_step_boundary() -> None:
    inst = DecodeInstance(0, _costs(), max_kv_tokens=10_000, max_batch_size=4)
    ev = inst.add(0.0, _seq(0, 0, 10))  # steps of 10 ms (+1 us per token)
    cut = inst.add(0.015, _seq(1, 0, 2, now=0.015))  # arrives inside step 2
    assert cut is not None and cut.token != ev.token
    assert cut.time_s == pytest.approx(0.020001)  # end of step 2, not of the whole run
    assert inst.on_step_done(ev.time_s, ev.token) == ([], [], None)  # the stale event
    _, done, nxt = inst.on_step_done(cut.time_s, cut.token)
    assert done == [] and inst.batch_size == 2 and nxt is not None
    # Now a batch of 2: contexts 2 + 0 = 2 tokens; seq 1 finishes after 2 steps.
    _, done, _ = inst.on_step_done(nxt.time_s, nxt.token)
    assert [s.req for s in done] == [1]
    gaps = done[0].gaps.gaps()
    # seq 1's first gap includes its wait from 0.015 to the boundary at 0.020001
    assert gaps[0] == pytest.approx(0.020001 - 0.015 + 0.010 + 2e-6)


def test_kv_capacity_makes_a_sequence_wait_for_room() -> None:
    inst = DecodeInstance(0, _costs(), max_kv_tokens=1000, max_batch_size=4)
    inst.add(0.0, _seq(0, 500, 2))  # reserves 503 tokens, 2 steps
    cut = inst.add(0.001, _seq(1, 600, 2))  # 503 + 603 > 1000
    assert cut is not None  # the run is cut after step 1 to try the join...
    _, done, nxt = inst.on_step_done(cut.time_s, cut.token)
    assert done == [] and [s.req for s in inst.running] == [0]  # ...which does not fit
    assert [s.req for s in inst.waiting] == [1] and nxt is not None
    _, done, nxt = inst.on_step_done(nxt.time_s, nxt.token)
    assert [s.req for s in done] == [0]  # seq 0 finished and freed its KV: seq 1 joins
    assert [s.req for s in inst.running] == [1] and not inst.waiting
    assert inst.reserved_tokens == 603 and nxt is not None


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="max_kv_tokens"):
        DecodeInstance(0, _costs(), max_kv_tokens=0, max_batch_size=1)
    with pytest.raises(ValueError, match="chunk_budget_tokens"):
        DecodeInstance(0, _costs(), 100, 8, colocated=True, chunk_budget_tokens=8)
    inst = DecodeInstance(0, _costs(), 100, 8)
    with pytest.raises(ValueError, match="not colocated"):
        inst.add_prefill(0.0, _seq(0, 10, 1))


def _drain(inst: DecodeInstance, event) -> list[tuple[float, int]]:  # type: ignore[no-untyped-def]
    """Run the instance's events to the end; (time, req) of each finish."""
    finished = []
    while event is not None:
        _, done, event = inst.on_step_done(event.time_s, event.token)
        finished += [(event.time_s if event else 0.0, s.req) for s in done]
    return finished


def test_a_sequence_past_its_reservation_grows_then_the_newest_is_preempted() -> None:
    # KV for 20 tokens. A and B each hold a 5-token prompt and reserve 7 (told 2 output tokens)
    # but generate 10. B joins after A's first step (A 6, B 5: 14 held, 6 free). Then one run
    # of the most steps whose growth fits the free 6: in 4 steps A grows 3 (to 10) and B 2 (to
    # 9), 19 held; a 5th would need 7. The next step needs 2 more tokens, 1 is free: B, the
    # newest, is preempted (swapped out, 9 tokens), and may not come back until there is room
    # for its 9 tokens and both next tokens. A finishes alone (15 held), then B resumes.
    inst = DecodeInstance(0, _costs(), max_kv_tokens=20, max_batch_size=4)
    a, b = Seq(0, 5, 10, 7), Seq(1, 5, 10, 7)
    inst.add(0.0, a)
    event = inst.add(0.0, b)  # cuts A's first run after one step
    assert event is not None
    held = []
    while event is not None and not inst.preemptions:
        _, done, event = inst.on_step_done(event.time_s, event.token)
        held.append((a.context_len, b.context_len, inst.reserved_tokens))
    assert held == [(6, 5, 14), (10, 9, 10)]  # 19 held, then B preempted
    assert inst.preemptions == 1 and b.preemptions == 1
    assert [s.req for s in inst.running] == [0] and [s.req for s in inst.waiting] == [1]
    assert (inst.reserved_tokens, inst.swapped_tokens, inst.kv_tokens) == (10, 9, 19)
    assert inst.take_joined() == [a, b]  # joined once each: a comeback is not a new join
    assert [req for _, req in _drain(inst, event)] == [0, 1]
    assert inst.take_joined() == []
    assert a.remaining == b.remaining == 0 and (a.context_len, b.context_len) == (15, 15)
    assert (inst.reserved_tokens, inst.swapped_tokens) == (0, 0)
    # B's stall while swapped out (A's last 5 steps) is in its gap after the comeback
    assert max(b.gaps.gaps()) > 5 * 0.010


def test_a_sequence_within_its_reservation_never_grows_nor_is_preempted() -> None:
    # Reserving its whole life (prompt + output), as every colocated sequence does: the
    # reservation stays put and nothing is preempted, however full the node.
    inst = DecodeInstance(0, _costs(), max_kv_tokens=32, max_batch_size=4)
    a, b = _seq(0, 5, 10), _seq(1, 5, 10)  # reserve 16: prompt, 10 more tokens and one spare
    inst.add(0.0, a)
    event = inst.add(0.0, b)
    while event is not None:
        assert inst.reserved_tokens in (16, 32)  # each holds its 16, never more
        _, _, event = inst.on_step_done(event.time_s, event.token)
    assert inst.preemptions == 0 and a.remaining == b.remaining == 0 and inst.reserved_tokens == 0


def test_a_colocated_prefill_is_reported_started_once_at_its_first_chunk() -> None:
    inst = DecodeInstance(0, _costs(), max_kv_tokens=10_000, max_batch_size=4, colocated=True,
                          chunk_budget_tokens=104)
    a = Seq(0, 300, 2, 303, prefix_len=100, prefill_done_len=100)  # 200 tokens: two chunks
    b = Seq(1, 200, 2, 203)
    ev = inst.add_prefill(0.0, a)
    assert ev is not None and inst.take_started() == [a]  # its first chunk, past its prefix
    assert inst.add_prefill(0.001, b) is None  # a's one-step run ends at the boundary anyway
    assert inst.take_started() == []  # b waits behind a
    starts: list[tuple[int, float]] = []
    while ev is not None:
        first, _, ev = inst.on_step_done(ev.time_s, ev.token)
        starts += [(s.req, s.prefill_done_len) for s in inst.take_started()]
        if first == [a]:
            assert starts == [(1, 0)]  # b's first chunk follows a's last
    assert starts == [(1, 0)] and b.prefill_started  # once: not again on b's later chunks
