"""The live profile's host terms: a decode step's per-step overhead (the worker's time outside
the timed engine step) and its factor while the host's prefill worker computes
(`decode_prefill_busy`), switched at the decode run's next step boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcake.conductor import DecodePoint, DecodeStepPredictor, PrefillPoint, PrefillTimePredictor
from kvcake.sim.config import SimConfig
from kvcake.sim.decode import DecodeInstance, Seq, StepCosts
from kvcake.sim.live_profile import live_cost_from_dict
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace, TraceRequest

SHAPE = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
         "intermediate_size": 1408, "vocab_size": 32000}


def profile(contention: Any = None, overhead: Any = None) -> dict[str, Any]:
    # prefill: 1 ms per new token; decode step: 10 ms + 1 ms per sequence (no context term)
    prefill = PrefillTimePredictor.fit([PrefillPoint(n, p, 1e-3 * (n - p))
                                        for n in (128, 512, 1024, 2048)
                                        for p in (0, n // 2, 9 * n // 10)])
    decode = DecodeStepPredictor.fit([DecodePoint(b, b * c, 0.010 + 0.001 * b)
                                      for b in (1, 8) for c in (256, 2048)])
    live: dict[str, Any] = {"transfer_bandwidth_bytes_per_s": 1e12, "kv_pool_tokens": 65536,
                            "shape": SHAPE, "dtype_bytes": 4}
    if contention is not None:
        live["contention"] = contention
    if overhead is not None:
        live["decode_step_overhead_s"] = overhead
    return {"prefill": json.loads(prefill.to_json()), "decode": json.loads(decode.to_json()),
            "live": live}


def test_overhead_adds_to_every_step_and_busy_factor_applies_while_prefilling() -> None:
    cost = live_cost_from_dict(profile({"decode": 1.5, "decode_prefill_busy": 3.0}, 0.002))
    assert cost.host_coupled
    # batch 2: fit 12 ms; idle 1.5 x 12 + 2 = 20 ms, busy 3 x 12 + 2 = 38 ms
    assert cost.decode_step_time_s(2, 1000) == pytest.approx(0.020)
    assert cost.decode_step_busy_time_s(2, 1000) == pytest.approx(0.038)
    assert cost.decode_step_time_s(0, 0) == 0.0 == cost.decode_step_busy_time_s(0, 0)
    plain = live_cost_from_dict(profile())
    assert not plain.host_coupled and plain.decode_step_overhead_s == 0.0
    assert plain.decode_step_busy_time_s(2, 1000) == pytest.approx(0.012)  # = the idle step


@pytest.mark.parametrize(("contention", "overhead", "error"), [
    ({"decode_prefill_busy": 0.0}, None, "decode_prefill_busy must be a positive finite"),
    (None, -0.001, "decode_step_overhead_s must be finite seconds >= 0"),
    (None, float("inf"), "decode_step_overhead_s must be finite seconds >= 0"),
    ({"busy": 2.0}, None, "live.contention: expected"),
])
def test_bad_host_terms_are_refused_by_name(contention: Any, overhead: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        live_cost_from_dict(profile(contention, overhead))


def _costs() -> StepCosts:
    # idle step 10 ms, busy step 30 ms (no context term)
    return StepCosts(lambda b, c: 0.010 if b else 0.0, lambda n, p: 0.001 * (n - p),
                     decode_step_busy_s=lambda b, c: 0.030 if b else 0.0)


def test_a_busy_host_cuts_the_run_at_the_next_boundary_and_slows_the_rest() -> None:
    busy = [False]
    inst = DecodeInstance(0, _costs(), max_kv_tokens=10_000, max_batch_size=4)
    inst.host_prefill_busy = lambda: busy[0]
    first = inst.add(0.0, Seq(0, 100, 5, 106))
    assert first is not None and first.time_s == pytest.approx(0.050)  # 5 idle steps
    assert inst.follow_host(0.005) is None  # nothing changed
    busy[0] = True
    cut = inst.follow_host(0.015)  # inside step 2
    assert cut is not None and cut.time_s == pytest.approx(0.020)  # step 2 keeps its cost
    assert inst.follow_host(0.016) is None  # already cut there
    assert inst.on_step_done(first.time_s, first.token) == ([], [], None)  # the stale run
    _, done, nxt = inst.on_step_done(cut.time_s, cut.token)
    assert done == [] and nxt is not None
    assert nxt.time_s == pytest.approx(0.020 + 3 * 0.030)  # the 3 steps left, busy
    assert inst.follow_host(0.05) is None  # planned busy, still busy
    _, done, _ = inst.on_step_done(nxt.time_s, nxt.token)
    assert [s.req for s in done] == [0]
    assert done[0].gaps.num_gaps == 5


def test_without_a_busy_cost_nothing_is_cut() -> None:
    inst = DecodeInstance(0, StepCosts(lambda b, c: 0.010, lambda n, p: 0.0), 10_000, 4)
    inst.host_prefill_busy = lambda: True
    first = inst.add(0.0, Seq(0, 100, 5, 106))
    assert first is not None and first.time_s == pytest.approx(0.050)
    assert inst.follow_host(0.015) is None


def test_the_cluster_slows_decode_steps_only_while_its_prefill_runs() -> None:
    # request 0: 64-token prompt (64 ms prefill), then 40 decode steps of 11 ms alone (from
    # 0.064 s); request 1 (100 tokens, one output token: it never decodes) prefills 0.2-0.3 s
    requests = (TraceRequest(0, 0.0, 64, 41, (0, 1)), TraceRequest(1, 200.0, 100, 1, (2, 3, 4, 5)))
    trace = Trace(requests, "test", block_size=32)
    config = SimConfig(num_prefill=1, num_decode=1, policy="global_cache", block_size=32,
                       admission="none")

    def finish_of_0(contention: dict[str, float]) -> float:
        cost = live_cost_from_dict(profile(contention)).as_cost_model()
        state = simulate(config, trace, cost).states[0]
        assert state.finish_s is not None
        return state.finish_s

    assert finish_of_0({}) == pytest.approx(0.064 + 40 * 0.011)
    # 13 idle steps to 0.207 (the prefill starts inside step 13, which keeps its cost), 5 busy
    # steps of 22 ms to 0.317 (it ends inside the 5th), the 22 left idle again
    assert finish_of_0({"decode_prefill_busy": 2.0}) == pytest.approx(
        0.064 + 13 * 0.011 + 5 * 0.022 + 22 * 0.011)
    assert finish_of_0({"decode": 2.0, "decode_prefill_busy": 2.0}) == pytest.approx(
        0.064 + 40 * 0.022)  # every step 2x


def test_a_prefill_started_while_the_host_decodes_takes_the_busy_factor() -> None:
    # request 0 decodes from 0.064 s to 0.504 s; a 100-token prompt (100 ms alone) arrives at
    # `at` s: while request 0 decodes its prefill takes 2 x 100 ms, after that 100 ms
    config = SimConfig(num_prefill=1, num_decode=1, policy="global_cache", block_size=32,
                       admission="none")
    cost = live_cost_from_dict(profile({"prefill_decode_busy": 2.0})).as_cost_model()
    assert live_cost_from_dict(profile({"prefill": 1.6, "prefill_decode_busy": 2.0})) \
        .prefill_busy_ratio == pytest.approx(2.0 / 1.6)
    assert live_cost_from_dict(profile()).prefill_busy_ratio is None

    def ttft_of_1(at: float) -> float:
        requests = (TraceRequest(0, 0.0, 64, 41, (0, 1)),
                    TraceRequest(1, 1000.0 * at, 100, 1, (2, 3, 4, 5)))
        ttft = simulate(config, Trace(requests, "test", block_size=32), cost).states[1].ttft_s
        assert ttft is not None
        return ttft

    assert ttft_of_1(0.2) == pytest.approx(0.200)
    assert ttft_of_1(0.6) == pytest.approx(0.100)
    # request 0's own prefill started with no batch on the host: 64 ms, as the fit says
    plain = simulate(config, Trace((TraceRequest(0, 0.0, 64, 41, (0, 1)),), "t", block_size=32),
                     cost).states[0]
    assert plain.ttft_s == pytest.approx(0.064)
