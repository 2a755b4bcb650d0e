"""The colocated workers' step terms: the live profile's `colocated` section
(kvcake/sim/colocated_cost.py), a colocated instance's runs following the other worker
(kvcake/sim/decode.py, host.py), a mixed step's chunk priced by its own factor
(`chunk_mixed*`), and the terms measured from tiny two-worker step traces
(benchmarks/colocated_terms.py: decode-only, mixed and chunk-only steps apart), with exact
expectations."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvcake.conductor import DecodePoint, DecodeStepPredictor, PrefillPoint, PrefillTimePredictor
from kvcake.sim.decode import DecodeInstance, Seq, StepCosts
from kvcake.sim.host import SharedHost
from kvcake.sim.live_profile import live_cost_from_dict
from tests.sim.test_host_coupling import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import colocated_terms  # noqa: E402

TERMS = {"decode": 1.5, "decode_other_busy": 3.0, "chunk": 2.0, "chunk_other_busy": 4.0,
         "step_overhead_s": 0.002}


def with_terms(terms: Any) -> dict[str, Any]:
    data = profile()
    data["live"]["colocated"] = terms
    return data


def test_colocated_step_costs_price_decode_and_chunk_by_the_other_worker() -> None:
    cost = live_cost_from_dict(with_terms(TERMS))
    assert cost.colocated is not None
    costs = cost.colocated.step_costs(cost)
    # decode fit at batch 2: 12 ms; idle 1.5 x 12 + 2 = 20 ms, other busy 3 x 12 + 2 = 38 ms
    assert costs.decode_step_s(2, 1000) == pytest.approx(0.020)
    assert costs.decode_step_busy_s is not None
    assert costs.decode_step_busy_s(2, 1000) == pytest.approx(0.038)
    assert costs.decode_step_s(0, 0) == 0.0
    # a 20-token chunk of a 512-token prompt (fit 512 ms): 20 ms of it, x2 idle, x4 busy
    assert costs.chunk_s is not None and costs.chunk_busy_s is not None
    assert costs.chunk_s(512, 0, 20, 22) == pytest.approx(0.040, rel=1e-3)
    assert costs.chunk_busy_s(512, 0, 20, 22) == pytest.approx(0.080, rel=1e-3)
    assert costs.step_overhead_s == 0.002
    assert live_cost_from_dict(profile()).colocated is None


@pytest.mark.parametrize("bad", [{"chunk": 0}, {"decode_other_busy": float("inf")},
                                 {"step_overhead_s": -1}, {"mixed": 1.0}, [1.0]])
def test_bad_colocated_terms_are_refused_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="live.colocated"):
        live_cost_from_dict(with_terms(bad))


def _chunk_costs() -> StepCosts:
    """Chunk-only steps: 1 ms overhead + 1 ms a chunk token (2 ms while the other steps)."""
    return StepCosts(lambda b, c: 0.010 * b, lambda n, p: 0.0,
                     lambda n, p, k, f: 0.001 * k, 0.001,
                     lambda b, c: 0.020 * b, lambda n, p, k, f: 0.002 * k)


def test_a_chunk_run_is_cut_when_the_other_worker_starts_and_the_rest_is_dearer() -> None:
    busy = [False]
    inst = DecodeInstance(0, _chunk_costs(), 10_000, 25, colocated=True, chunk_budget_tokens=26)
    inst.host_prefill_busy = lambda: busy[0]
    # a 100-token prompt, chunks of 26: 3 full chunk steps of 27 ms, idle
    first = inst.add_prefill(0.0, Seq(0, 100, 0, 101))
    assert first is not None and first.time_s == pytest.approx(0.081)
    assert inst.follow_host(0.01) is None  # nothing changed
    busy[0] = True
    cut = inst.follow_host(0.03)  # inside step 2
    assert cut is not None and cut.time_s == pytest.approx(0.054)  # step 2 keeps its cost
    got, _, nxt = inst.on_step_done(cut.time_s, cut.token)
    assert got == [] and nxt is not None
    # 48 tokens left: one full chunk, busy: 1 + 2 x 26 = 53 ms
    assert nxt.time_s == pytest.approx(0.054 + 0.053)
    got, _, last = inst.on_step_done(nxt.time_s, nxt.token)
    assert got == [] and last is not None
    # the last 22 tokens: 1 + 2 x 22 = 45 ms; the first token then
    assert last.time_s == pytest.approx(0.107 + 0.045)
    got, _, _ = inst.on_step_done(last.time_s, last.token)
    assert [s.req for s in got] == [0]


def test_colocated_instances_follow_each_other_not_a_prefill_worker() -> None:
    a = DecodeInstance(0, _chunk_costs(), 10_000, 25, colocated=True, chunk_budget_tokens=26)
    b = DecodeInstance(1, _chunk_costs(), 10_000, 25, colocated=True, chunk_budget_tokens=26)
    cost = live_cost_from_dict(profile()).as_cost_model()
    host = SharedHost([], [a, b], cost, colocated=True)
    assert host.coupled == [a, b]
    assert a.host_prefill_busy is not None and b.host_prefill_busy is not None
    assert not a.host_prefill_busy() and not b.host_prefill_busy()
    b.add_prefill(0.0, Seq(0, 100, 0, 101))
    assert a.host_prefill_busy() and not b.host_prefill_busy()


DECODE = DecodeStepPredictor.fit([DecodePoint(b, c, 0.010) for b in (1, 4) for c in (64, 512)])
PREFILL = PrefillTimePredictor.fit([PrefillPoint(n, p, 1e-3 * (n - p))
                                    for n in (100, 200, 400, 800) for p in (0, n // 2, n // 4)])


def saved() -> dict[str, Any]:
    """Worker a: decode steps (fit 10 ms) of 12 ms alone (0.0-0.9 s) and 15 ms while worker b
    steps (1.0-1.9 s), 1 ms apart; worker b, 1.0-1.9 s: mixed steps of one decode row and a
    20-token chunk of a 400-token prompt (fit 20 ms), 12 + 2 x 20 = 52 ms wall while a steps
    beside it (busy class: decode 1.5, so 15 + 20 g = 52 -> g = 1.85)."""
    steps: list[dict[str, Any]] = []

    def run(worker: str, start: float, end: float, wall: float, chunk: bool) -> None:
        t = start
        while t + wall <= end:
            steps.append({"worker": worker, "t0": t, "t1": t + wall, "t2": t + wall,
                          "cpu": wall, "rows": [["d", 100]],
                          "chunks": [["p", 0, 20, 400]] if chunk else []})
            t += wall + 0.001

    run("a", 0.0, 0.9, 0.012, False)
    run("a", 1.0, 1.9, 0.015, False)
    run("b", 1.0, 1.9, 0.052, True)
    return {"steps": steps, "cpu": [], "rate": 1.0, "requests": []}


def test_terms_measured_from_a_two_worker_trace() -> None:
    got = colocated_terms.measure(saved(), DECODE, PREFILL)
    terms = got["colocated"]
    assert terms["decode"] == pytest.approx(1.2, rel=1e-3)
    assert terms["decode_other_busy"] == pytest.approx(1.5, rel=1e-3)
    assert terms["chunk_other_busy"] == pytest.approx((0.052 - 1.5 * 0.010) / 0.020, rel=1e-3)
    assert terms["chunk"] == terms["chunk_other_busy"]  # no idle chunk step: the other's
    assert terms["step_overhead_s"] == pytest.approx(0.001)
    # every step exactly on its class's model: no dispersion
    assert got["step_jitter_quantiles"][0] == pytest.approx(1.0, rel=1e-3)
    assert got["step_jitter_quantiles"][-1] == pytest.approx(1.0, rel=1e-3)
    # the live profile takes them as they are
    assert live_cost_from_dict(with_terms(terms)).colocated is not None


def test_the_colocated_cluster_prices_its_steps_by_the_colocated_terms() -> None:
    from kvcake.sim.config import SimConfig
    from kvcake.sim.run import simulate
    from kvcake.sim.trace import Trace, TraceRequest

    # one request alone (the other worker idle): a 64-token prompt in chunks of 33 and 31
    # tokens (budget 33, no batch), each 2 ms + 2 x 1 ms a token (the prefill fit's 1 ms, x2);
    # then 2 decode steps of 1.5 x 11 ms + 2 ms
    trace = Trace((TraceRequest(0, 0.0, 64, 3, (0, 1)),), "test", block_size=32)
    config = SimConfig(num_prefill=1, num_decode=1, policy="colocated", chunked_prefill=True,
                       chunk_budget_tokens=33, max_batch_size=32, block_size=32,
                       admission="none")
    cost = live_cost_from_dict(with_terms(TERMS)).as_cost_model()
    state = simulate(config, trace, cost).states[0]
    assert state.first_token_s == pytest.approx(0.002 + 0.066 + 0.002 + 0.062, rel=1e-6)
    assert state.finish_s == pytest.approx(0.132 + 2 * 0.0185, rel=1e-6)


MIXED_TERMS = {**TERMS, "chunk_mixed": 1.25, "chunk_mixed_other_busy": 1.5}


def test_a_chunk_beside_decode_rows_takes_the_mixed_factor() -> None:
    cost = live_cost_from_dict(with_terms(MIXED_TERMS))
    assert cost.colocated is not None
    costs = cost.colocated.step_costs(cost)
    assert costs.chunk_s is not None and costs.chunk_busy_s is not None
    # a 20-token chunk of a 512-token prompt: 20 ms on the fit; beside 2 decode rows (a
    # 22-token forward) x1.25 idle, x1.5 busy; alone (a 20-token forward) x2 / x4 as before
    assert costs.chunk_s(512, 0, 20, 22) == pytest.approx(0.025, rel=1e-3)
    assert costs.chunk_busy_s(512, 0, 20, 22) == pytest.approx(0.030, rel=1e-3)
    assert costs.chunk_s(512, 0, 20, 20) == pytest.approx(0.040, rel=1e-3)
    assert costs.chunk_busy_s(512, 0, 20, 20) == pytest.approx(0.080, rel=1e-3)


@pytest.mark.parametrize(("bad", "error"), [
    ({"chunk_mixed": 1.2}, "give both chunk_mixed and chunk_mixed_other_busy"),
    ({"chunk_mixed_other_busy": 1.2}, "give both chunk_mixed and chunk_mixed_other_busy"),
    ({"chunk_mixed": 0.0, "chunk_mixed_other_busy": 1.2}, "live.colocated.chunk_mixed must be"),
    ({"chunk_mixed": 1.0, "chunk_mixed_other_busy": float("nan")},
     "live.colocated.chunk_mixed_other_busy must be"),
    ({"chunk_mixed": "fast", "chunk_mixed_other_busy": 1.0}, "every value must be a number"),
])
def test_bad_mixed_terms_are_refused_by_name(bad: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        live_cost_from_dict(with_terms({**TERMS, **bad}))


@pytest.mark.parametrize(("terms", "mixed_s"), [
    (MIXED_TERMS, 0.0185 + 1.25 * 0.128),  # decode 1.5 x 11 + 2 ms, the chunk x1.25
    (TERMS, 0.0185 + 2.0 * 0.128),  # no mixed factor: the chunk-only factor, as before
])
def test_an_instance_prices_its_mixed_step_with_the_mixed_factor(terms: Any,
                                                                 mixed_s: float) -> None:
    cost = live_cost_from_dict(with_terms(terms))
    assert cost.colocated is not None
    inst = DecodeInstance(0, cost.colocated.step_costs(cost), 10_000, 32, colocated=True,
                          chunk_budget_tokens=129)
    inst.add(0.0, Seq(0, 100, 5, 105))  # one decode row (fit 11 ms at batch 1)
    cut = inst.add_prefill(0.0, Seq(1, 128, 3, 131))  # the run is cut after its first step
    assert cut is not None and cut.time_s == pytest.approx(0.0185)
    _, _, mixed = inst.on_step_done(cut.time_s, cut.token)
    # one mixed step: the row and the whole 128-token prompt (fit 128 ms), budget 129
    assert mixed is not None and mixed.time_s == pytest.approx(0.0185 + mixed_s, rel=1e-3)
    got, _, _ = inst.on_step_done(mixed.time_s, mixed.token)
    assert [s.req for s in got] == [1]


def saved_three_kinds() -> dict[str, Any]:
    """`saved()` and worker b's chunk-only steps, 2.0-2.86 s: a 20-token chunk of another
    400-token prompt (fit 20 ms), 40 ms wall, with worker a's decode steps of 15 ms beside them
    (2.0-2.87 s: each step of either worker over half beside the other's; busy class: chunk-only
    2.0, against 1.85 for the chunk of b's mixed steps)."""
    data = saved()
    steps = data["steps"]
    for worker, wall, chunk, end in (("a", 0.015, False, 2.87), ("b", 0.040, True, 2.9)):
        t = 2.0
        while t + wall <= end:
            steps.append({"worker": worker, "t0": t, "t1": t + wall, "t2": t + wall, "cpu": wall,
                          "rows": [] if chunk else [["d", 100]],
                          "chunks": [["q", 0, 20, 400]] if chunk else []})
            t += wall + 0.001
    return data


def test_mixed_and_chunk_only_steps_are_measured_apart() -> None:
    got = colocated_terms.measure(saved_three_kinds(), DECODE, PREFILL)
    terms = got["colocated"]
    assert terms["decode"] == pytest.approx(1.2, rel=1e-3)
    assert terms["decode_other_busy"] == pytest.approx(1.5, rel=1e-3)
    # mixed: (52 - 1.5 x 10) / 20 ms; chunk only: 40 / 20 ms; no idle chunk step: the busy ones
    assert terms["chunk_mixed_other_busy"] == pytest.approx(1.85, rel=1e-3)
    assert terms["chunk_other_busy"] == pytest.approx(2.0, rel=1e-3)
    assert terms["chunk_mixed"] == terms["chunk_mixed_other_busy"]
    assert terms["chunk"] == terms["chunk_other_busy"]
    # every step on its kind's model (the last, partly overlapped steps of each worker too)
    assert got["step_jitter_quantiles"][0] == pytest.approx(1.0, rel=1e-3)
    assert got["step_jitter_quantiles"][-1] == pytest.approx(1.0, rel=1e-3)
    cost = live_cost_from_dict(with_terms(terms))
    assert cost.colocated is not None and cost.colocated.chunk_mixed == terms["chunk_mixed"]
