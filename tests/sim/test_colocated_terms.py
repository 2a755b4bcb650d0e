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


# -- factors per decode-row bucket (live.colocated.by_rows) ------------------------------------

ROWS_TERMS = {**MIXED_TERMS, "by_rows": {"decode": [1.0, None, 2.0],
                                         "decode_other_busy": [4.0],
                                         "chunk_mixed_other_busy": [None, 3.0]}}


@pytest.mark.parametrize(("rows", "bucket"), [(1, 0), (2, 1), (3, 2), (4, 3), (9, 3)])
def test_a_step_s_decode_rows_pick_its_bucket(rows: int, bucket: int) -> None:
    assert colocated_terms.ROW_BUCKETS == 4
    assert colocated_terms.row_bucket(rows) == bucket


def test_a_step_without_decode_rows_has_no_bucket() -> None:
    with pytest.raises(ValueError, match="a row bucket needs >= 1 decode rows, got 0"):
        colocated_terms.row_bucket(0)


def test_steps_are_priced_by_their_row_bucket_and_null_takes_the_pooled_factor() -> None:
    cost = live_cost_from_dict(with_terms(ROWS_TERMS))
    assert cost.colocated is not None
    costs = cost.colocated.step_costs(cost)
    assert costs.decode_step_busy_s is not None and costs.chunk_busy_s is not None
    assert costs.chunk_s is not None
    # decode fit 11 ms at batch 1, 12 ms at 2 (+1 ms a row); 2 ms overhead a step
    assert costs.decode_step_s(1, 1000) == pytest.approx(1.0 * 0.011 + 0.002)
    assert costs.decode_step_s(2, 1000) == pytest.approx(1.5 * 0.012 + 0.002)  # null: pooled
    assert costs.decode_step_s(3, 1000) == pytest.approx(2.0 * 0.013 + 0.002)
    assert costs.decode_step_s(7, 1000) == pytest.approx(2.0 * 0.017 + 0.002)  # the last: 3+
    assert costs.decode_step_busy_s(5, 1000) == pytest.approx(4.0 * 0.015 + 0.002)  # 1+
    # a 20-token chunk of a 512-token prompt: 20 ms on the fit; the decode rows beside it are
    # the forward's tokens less the chunk's
    assert costs.chunk_busy_s(512, 0, 20, 21) == pytest.approx(0.030, rel=1e-3)  # 1 row: pooled
    assert costs.chunk_busy_s(512, 0, 20, 22) == pytest.approx(0.060, rel=1e-3)  # 2 rows: 3.0
    assert costs.chunk_busy_s(512, 0, 20, 26) == pytest.approx(0.060, rel=1e-3)  # 6 rows: 2+
    assert costs.chunk_s(512, 0, 20, 22) == pytest.approx(0.025, rel=1e-3)  # no idle table
    # a chunk-only step has no rows: the chunk-only factor
    assert costs.chunk_busy_s(512, 0, 20, 20) == pytest.approx(0.080, rel=1e-3)


@pytest.mark.parametrize("terms", [TERMS, MIXED_TERMS])
def test_a_profile_without_the_table_prices_as_before(terms: dict[str, Any]) -> None:
    nulls = {**terms, "by_rows": {k: [None] * 4 for k in
                                  ("decode", "decode_other_busy", "chunk_mixed",
                                   "chunk_mixed_other_busy")}}
    priced = []
    for data in (terms, nulls, {**terms, "by_rows": {}}):
        cost = live_cost_from_dict(with_terms(data))
        assert cost.colocated is not None
        c = cost.colocated.step_costs(cost)
        assert c.chunk_s is not None and c.chunk_busy_s is not None
        assert c.decode_step_busy_s is not None
        priced.append([c.decode_step_s(b, 900) for b in range(6)]
                      + [c.decode_step_busy_s(b, 900) for b in range(6)]
                      + [f(512, 64, 20, 20 + b) for f in (c.chunk_s, c.chunk_busy_s)
                         for b in range(6)])
    assert live_cost_from_dict(with_terms(terms)).colocated.by_rows is None  # type: ignore[union-attr]
    assert priced[0] == priced[1] == priced[2]


@pytest.mark.parametrize(("bad", "error"), [
    ([1.0], r"live.colocated.by_rows: expected"),
    ({"chunk": [1.0]}, r"live.colocated.by_rows: expected"),
    ({"decode": 1.2}, r"live.colocated.by_rows: expected"),
    ({"decode": [1.2, 0.0]}, r"live.colocated.by_rows.decode\[1\] must be a positive finite"),
    ({"chunk_mixed": [float("inf")]}, r"live.colocated.by_rows.chunk_mixed\[0\] must be"),
    ({"decode_other_busy": ["fast"]}, r"live.colocated.by_rows.decode_other_busy\[0\] must be"),
    ({"decode": [True]}, r"live.colocated.by_rows.decode\[0\] must be"),
    ({"decode": [1.0] * 65}, r"live.colocated.by_rows.decode must be a list of at most 64"),
])
def test_a_bad_row_table_is_refused_by_name(bad: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        live_cost_from_dict(with_terms({**TERMS, "by_rows": bad}))


def step(kind: str, rows: int, wall: float, decode_s: float, chunk_s: float = 0.0,
         busy: bool = True) -> dict[str, Any]:
    """One priced step as `colocated_terms.priced` returns it."""
    return {"kind": kind, "rows": [["r", 10]] * rows, "wall": wall, "decode_s": decode_s,
            "chunk_s": chunk_s, "other_busy": 1.0 if busy else 0.0}


POOLED = {"decode": 1.1, "decode_other_busy": 1.3, "chunk_mixed": 1.0,
          "chunk_mixed_other_busy": 1.2}


def test_row_factors_per_bucket_with_the_bucket_s_decode_factor_in_mixed_steps() -> None:
    steps = ([step("decode", 1, 0.012, 0.010)] * 3          # busy, 1 row: 1.2
             + [step("decode", 2, 0.028, 0.020)] * 3        # busy, 2 rows: 1.4
             + [step("decode", 5, 0.025, 0.020)] * 2        # busy, 4+ (5 and 6 rows): 1.25
             + [step("decode", 6, 0.025, 0.020)]
             + [step("mixed", 2, 0.068, 0.020, 0.030)] * 3  # busy, 2 rows: (68 - 1.4 x 20) / 30
             + [step("mixed", 4, 0.046, 0.020, 0.020)] * 2  # busy, 4+ rows: too few
             + [step("decode", 3, 0.033, 0.030, busy=False)] * 3  # idle, 3 rows: 1.1
             + [step("chunk", 0, 0.050, 0.0, 0.030)] * 5)   # no rows: not in the table
    table, evidence = colocated_terms.row_factors(steps, POOLED, min_steps=3)
    assert table["decode_other_busy"] == [1.2, 1.4, None, pytest.approx(1.25)]
    assert table["chunk_mixed_other_busy"] == [None, pytest.approx(4 / 3, abs=1e-4), None,
                                                None]
    assert table["decode"] == [None, None, 1.1, None]
    assert table["chunk_mixed"] == [None] * 4
    four = evidence["decode_other_busy"][3]
    assert (four["rows"], four["steps"], four["fallback"]) == ("4+", 3, False)
    short = evidence["chunk_mixed_other_busy"][3]
    # less the 4+ bucket's decode factor (1.25, not the pooled 1.3): (46 - 1.25 x 20) / 20;
    # 2 steps: the pooled factor
    assert (short["steps"], short["factor"], short["fallback"]) == (2, 1.05, True)
    assert evidence["decode_other_busy"][0]["std_err"] == 0.0  # every step on its factor
    # a bucket of min_steps - 1 steps falls back; of min_steps it does not
    table, _ = colocated_terms.row_factors(steps, POOLED, min_steps=4)
    assert table["decode_other_busy"] == [None] * 4


def test_the_minimum_bucket_is_100_steps() -> None:
    assert colocated_terms.MIN_BUCKET_STEPS == 100
    steps = [step("decode", 1, 0.012, 0.010)] * 100 + [step("decode", 2, 0.028, 0.020)] * 99
    table, _ = colocated_terms.row_factors(steps, POOLED)
    assert table["decode_other_busy"] == [1.2, None, None, None]
    with pytest.raises(ValueError, match="min_steps must be >= 1"):
        colocated_terms.row_factors(steps, POOLED, min_steps=0)


def test_the_table_measured_from_a_two_worker_trace_prices_its_one_row_steps() -> None:
    got = colocated_terms.measure(saved(), DECODE, PREFILL, by_rows=True, min_steps=10)
    terms = got["colocated"]
    # every step has one decode row: bucket 1 holds the pooled factors, the rest are null
    assert terms["by_rows"]["decode"] == [pytest.approx(1.2, rel=1e-3), None, None, None]
    assert terms["by_rows"]["decode_other_busy"] == [pytest.approx(1.5, rel=1e-3), None, None,
                                                     None]
    assert terms["by_rows"]["chunk_mixed_other_busy"] == [pytest.approx(1.85, rel=1e-3), None,
                                                          None, None]
    assert terms["by_rows"]["chunk_mixed"] == [None] * 4  # no idle mixed step
    assert got["evidence"]["by_rows"]["min_steps"] == 10
    assert got["step_jitter_quantiles"][-1] == pytest.approx(1.0, rel=1e-3)
    assert "by_rows" not in colocated_terms.measure(saved(), DECODE, PREFILL)["colocated"]
    cost = live_cost_from_dict(with_terms(terms))
    assert cost.colocated is not None and cost.colocated.by_rows is not None
