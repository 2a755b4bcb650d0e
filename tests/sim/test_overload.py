"""The overload report's measures: each pool's demand on the cost model, the loads' swing."""

from __future__ import annotations

import pytest

from kvcake.conductor import CostModel
from kvcake.sim.overload import pool_demand, swing
from kvcake.sim.trace import Trace, TraceRequest

COST = CostModel.from_spec("llama3-70b@a800x8")


def test_pool_demand_prices_uncached_prefill_and_decode_memory_time() -> None:
    # Two requests 10 s apart; the second reuses the first's two 512-token blocks.
    trace = Trace((TraceRequest(0, 0.0, 2048, 100, (1, 2, 3, 4)),
                   TraceRequest(1, 10_000.0, 2048, 100, (1, 2, 5, 6))), "two")
    capacity = 1_000_000
    demand = pool_demand(trace, COST, capacity, 512)
    prefill = (COST.prefill_time_s(2048, 0) + COST.prefill_time_s(2048, 1024)) / 2
    assert demand.prefill_s == pytest.approx(prefill)
    step = COST.decode_step_time_s(capacity // 2148, capacity)
    assert demand.decode_s == pytest.approx(2148 * 100 * step / capacity)
    assert demand.arrival_rate == pytest.approx(0.1)
    assert demand.capacity(8, 4) == pytest.approx((8 / demand.prefill_s, 4 / demand.decode_s))


def test_swing_reads_anti_phase_and_in_phase_loads_inside_the_window() -> None:
    times = [10.0 * i for i in range(8)]
    prefill = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    anti = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    corr, cv = swing(times, prefill, anti, 0.0, 80.0)
    assert corr == pytest.approx(-1.0) and cv == pytest.approx(1.0)
    corr, cv = swing(times, prefill, prefill, 0.0, 80.0)
    assert corr == pytest.approx(1.0)
    # Buckets outside [begin, end) are left out: the first two only leave too few to say.
    assert swing(times, prefill, anti, 0.0, 20.0) == (0.0, 0.0)
    assert swing(times, prefill, [2.0] * 8, 0.0, 80.0) == (0.0, 0.0)  # flat decode: no swing


def test_t_d_is_the_mean_decode_time_of_finished_requests() -> None:
    from kvcake.sim.overload import mean_decode_s
    from kvcake.sim.records import RequestState
    from kvcake.sim.run import arrivals_of

    trace = Trace(tuple(TraceRequest(i, 0.0, 1024, 10, (i,)) for i in range(3)), "three")
    states = [RequestState(i, f"r{i}", a) for i, a in enumerate(arrivals_of(trace))]
    assert mean_decode_s(states) is None
    states[0].decode_join_s, states[0].finish_s = 1.0, 4.0
    states[1].decode_join_s, states[1].finish_s = 2.0, 3.0
    states[2].decode_join_s = 2.0  # still decoding (rejected or cut off): not counted
    assert mean_decode_s(states) == pytest.approx(2.0)


def test_pool_loads_spread_queue_busy_and_decode_kv_over_buckets() -> None:
    from kvcake.sim.overload import BUCKET_S, pool_loads, window_mean
    from kvcake.sim.records import RequestState
    from kvcake.sim.run import arrivals_of

    # One request: arrives at 0, waits 5 s, prefills 10 s (5..15), decodes 18..35 holding
    # 1,000 + 100 KV tokens; a second is rejected at arrival and loads nothing.
    trace = Trace((TraceRequest(0, 0.0, 1000, 100, (1, 2)),
                   TraceRequest(1, 0.0, 1000, 100, (3, 4))), "two")
    states = [RequestState(i, f"r{i}", a) for i, a in enumerate(arrivals_of(trace))]
    states[0].prefill_start_s, states[0].prefill_s = 5.0, 10.0
    states[0].decode_join_s, states[0].finish_s = 18.0, 35.0  # waited 15..18 for decode
    states[1].rejected = "tbt_slo"
    loads = pool_loads(states, num_prefill=2, num_decode=1, kv_capacity_tokens=2200,
                       end_s=35.0)
    assert BUCKET_S == 10.0 and loads.times == [0.0, 10.0, 20.0, 30.0]
    # In the prefill stage 0..15 (queue counts the wait, busy does not), over 2 nodes.
    assert loads.prefill_queue == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert loads.prefill_busy == pytest.approx([0.25, 0.25, 0.0, 0.0])
    # Half of the decode pool's KV (1,100 of 2,200) for 18..35.
    assert loads.decode_kv == pytest.approx([0.0, 0.1, 0.5, 0.25])
    assert loads.decode_batch == pytest.approx([0.0, 0.2, 1.0, 0.5])
    # Prefilled and not decoding 15..18: 0.3 of the bucket 10..20 on the one decode node.
    assert loads.decode_wait == pytest.approx([0.0, 0.3, 0.0, 0.0])
    assert window_mean(loads.times, loads.decode_kv, 10.0, 30.0) == pytest.approx(0.3)


def test_regime_names_the_overloaded_pool() -> None:
    from kvcake.sim.overload import regime_of

    assert regime_of(0.8, 1.25).startswith("decode-bound")
    assert regime_of(1.2, 0.9).startswith("prefill-bound")
    assert regime_of(1.13, 1.19) == "both pools overloaded"
    assert regime_of(0.5, 0.7) == "no pool overloaded on average"


def test_saved_per_turned_away_compares_later_rejections_with_the_baseline() -> None:
    from kvcake.sim.overload import saved_per_turned_away

    base = {"ttft_slo": 100, "tbt_slo_after_prefill": 80}
    # Turned 50 away at arrival; 60 fewer later rejections: 1.2 saved each (fewer in all).
    policy = {"ttft_slo": 70, "tbt_slo": 50, "tbt_slo_after_prefill": 50}
    assert saved_per_turned_away(base, policy) == pytest.approx(1.2)
    assert saved_per_turned_away(base, {"ttft_slo": 100}) is None  # none turned away


def test_early_rejection_moves_the_decode_check_to_arrival_and_the_baseline_keeps_it_late() -> None:
    """The arrival policies decide finally at arrival (the seed's Algorithm 1: the decode
    instance is pre-selected then): nothing is rejected after its prefill and no prefill is
    wasted. The baseline rejects at decode after the prefill, spending it. Early rejection
    counts what is dispatched to a decode node and not joined yet, so on this load it lets in
    nothing that finds its node full: none waits (served late), and the `CHECKED` form's check
    after prefill has nothing to reject (reading the load of the moment, it let in requests
    that waited, or were rejected there with their prefill spent)."""
    from dataclasses import replace

    from kvcake.sim.config import SimConfig
    from kvcake.sim.overload import CHECKED, POLICIES, run_changes
    from kvcake.sim.run import simulate
    from kvcake.sim.tracegen import TraceGenConfig, generate_trace

    assert [(n, r.decode_check_after_prefill) for n, r in POLICIES.items()] == [
        ("decode_after_prefill", True), ("early", False), ("prediction", False)]
    assert all(r.decode_check_after_prefill for r in CHECKED.values())
    assert [r.admission for r in CHECKED.values()] == [POLICIES["early"].admission,
                                                       POLICIES["prediction"].admission]
    changes = run_changes(POLICIES["early"], 60.0, 800)
    assert changes["decode_node_guard"] and not changes["decode_check_after_prefill"]
    assert changes["uniform_decode_s"] == 60.0 and changes["predicted_output_len"] == 800

    # Decode-bound: 4 prefill nodes feed 1 decode node long prompts with long outputs.
    trace = generate_trace(TraceGenConfig(num_requests=120, rate_per_s=2.0, seed=5,
                                          mean_first_message_len=30000, mean_followup_len=3000,
                                          mean_output_len=800, max_output_len=1600))
    base = SimConfig(num_prefill=4, num_decode=1)

    def run(name: str) -> dict[str, object]:
        runs = {**POLICIES, **CHECKED}
        return simulate(replace(base, **run_changes(runs[name], 60.0, 800)), trace).summary

    baseline, early = run("decode_after_prefill"), run("early")
    assert baseline["rejected_by_reason"]["tbt_slo_after_prefill"] > 0  # type: ignore[index]
    assert "tbt_slo" not in baseline["rejected_by_reason"]  # type: ignore[operator]
    assert baseline["wasted_prefill_s"] > 0  # type: ignore[operator]
    assert "tbt_slo_after_prefill" not in early["rejected_by_reason"]  # type: ignore[operator]
    assert early["wasted_prefill_s"] == 0.0
    assert early["rejected_by_reason"]["tbt_slo"] > 0  # type: ignore[index]
    assert early["completed"] == early["effective_requests"]
    checked = run("early+check_after_prefill")
    assert checked["rejected_by_reason"] == early["rejected_by_reason"]
    assert checked["wasted_prefill_s"] == 0.0


def test_served_mix_price_and_turn_aways_that_would_have_found_room() -> None:
    from kvcake.sim.overload_runs import served_prefill_s, turned_away_with_room
    from kvcake.sim.pool_loads import PoolLoads
    from kvcake.sim.records import RequestState
    from kvcake.sim.run import arrivals_of

    trace = Trace(tuple(TraceRequest(i, 1000.0 * i, 1024, 10, (i,)) for i in range(4)), "four")
    states = [RequestState(i, f"r{i}", a) for i, a in enumerate(arrivals_of(trace))]
    states[0].prefill_s, states[0].finish_s = 0.2, 5.0  # served
    states[1].prefill_s, states[1].finish_s = 0.4, 6.0  # served
    states[2].prefill_s, states[2].rejected = 0.3, "tbt_slo_after_prefill"  # wasted, not served
    states[3].rejected, states[3].predicted_ttft_s = "tbt_slo", 15.0  # turned away at 3 s
    assert served_prefill_s(states) == pytest.approx(0.3)
    # Buckets of 10 s: request 3 would have joined at 3 + 15 = 18 s, in the second bucket.
    loads = PoolLoads([0.0, 10.0, 20.0], [0.0] * 3, [0.0] * 3, [1.0, 0.5, 1.0], [0.0] * 3,
                      [0.0] * 3)
    assert turned_away_with_room(states, loads) == 1.0
    full = PoolLoads([0.0, 10.0, 20.0], [0.0] * 3, [0.0] * 3, [0.5, 0.95, 0.5], [0.0] * 3,
                     [0.0] * 3)
    assert turned_away_with_room(states, full) == 0.0
    assert turned_away_with_room(states[:3], loads) is None and served_prefill_s([]) is None


def test_prefill_admitted_sheds_the_dearest_prompts_first_and_prices_the_rest() -> None:
    from kvcake.sim.pool_loads import prefill_admitted

    # Three unrelated prompts over 10 s; the dearest arrives first.
    trace = Trace((TraceRequest(0, 0.0, 4096, 10, (1, 2, 3, 4, 5, 6, 7, 8)),
                   TraceRequest(1, 5_000.0, 1024, 10, (9, 10)),
                   TraceRequest(2, 10_000.0, 2048, 10, (11, 12, 13, 14))), "three")
    c = [COST.prefill_time_s(n, 0) for n in (4096, 1024, 2048)]
    capacity = 1_000_000
    # One node for 10 s at half its time: room for the two cheap prompts, not the dear one.
    efficiency = (c[1] + c[2] + c[0] / 2) / 10
    assert c[1] + c[2] < efficiency * 10 < sum(c)
    kept = prefill_admitted(trace, COST, capacity, 512, 1 * efficiency, 1.0)
    assert kept == {1, 2}
    # Replayed twice as fast the same budget is half: only the cheapest fits.
    assert prefill_admitted(trace, COST, capacity, 512, 1 * efficiency, 2.0) == {1}
    assert prefill_admitted(trace, COST, capacity, 512, 8, 1.0) == {0, 1, 2}  # not binding
    demand = pool_demand(trace, COST, capacity, 512, only=kept)
    assert demand.prefill_s == pytest.approx((c[1] + c[2]) / 2)
    assert demand.arrival_rate == pytest.approx(0.2 * 2 / 3)  # 2 of the 3 arrivals over 10 s
    with pytest.raises(ValueError, match="prefill_nodes"):
        prefill_admitted(trace, COST, capacity, 512, 0.0, 1.0)


def test_herding_is_the_top_decode_node_share_of_each_window_of_arrivals() -> None:
    from kvcake.sim.overload_runs import herding
    from kvcake.sim.records import RequestState
    from kvcake.sim.run import arrivals_of

    # Arrivals at 0, 1, 2, 3 s (one 10 s window) and 12, 13 s (the next); request 4 rejected.
    times = (0.0, 1000.0, 2000.0, 3000.0, 12000.0, 13000.0)
    trace = Trace(tuple(TraceRequest(i, t, 1024, 10, (i,)) for i, t in enumerate(times)), "six")
    states = [RequestState(i, f"r{i}", a) for i, a in enumerate(arrivals_of(trace))]
    for s, d in zip(states, ("d0", "d0", "d0", "d1", None, "d1"), strict=True):
        s.preselected_decode = d
    assert herding(states) == (pytest.approx((0.75 + 1.0) / 2), 1.0)
    assert herding(states, window_s=5.0) == (pytest.approx(0.875), 1.0)  # 3 of 4, then 1 of 1
    assert herding(states[4:5]) is None
    with pytest.raises(ValueError, match="window_s"):
        herding(states, window_s=0.0)


def test_rejections_by_window_split_by_arrival_time_and_reason() -> None:
    from kvcake.sim.overload_runs import rejections_by_window
    from kvcake.sim.records import RequestState
    from kvcake.sim.run import arrivals_of

    # Arrivals at 0, 1, 2, 3, 4 and 5 s over a 4 s window in two windows of 2 s (5 s: the last).
    trace = Trace(tuple(TraceRequest(i, 1000.0 * i, 1024, 10, (i,)) for i in range(6)), "six")
    states = [RequestState(i, f"r{i}", a) for i, a in enumerate(arrivals_of(trace))]
    for i, reason in enumerate(("ttft_slo", None, "tbt_slo", "tbt_slo_after_prefill",
                                "tbt_slo", "tbt_slo")):
        states[i].rejected = reason
    assert rejections_by_window(states, 4.0, 2) == [(1, 0, 0), (0, 3, 1)]
    assert rejections_by_window(states, 12.0, 1) == [(1, 3, 1)]
    with pytest.raises(ValueError, match="window_s"):
        rejections_by_window(states, 0.0)
