"""JSON shapes of benchmarks/serving_disagg_vs_colocated.py and benchmarks/sim_vs_live.py, and
their request plans, without servers or vLLM (step files and live results made up here)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import live_replays  # noqa: E402
import serving_disagg_vs_colocated as cap  # noqa: E402
import sim_vs_live  # noqa: E402
import simulated_runs  # noqa: E402

from kvcake.bench.regime import Regime, Replay, derive_regime  # noqa: E402
from kvcake.bench.stats import Outcome, RequestResult  # noqa: E402
from kvcake.sim.live_profile import live_cost_from_dict  # noqa: E402
from kvcake.sim.run import simulate  # noqa: E402
from kvcake.sim.trace import TraceRequest  # noqa: E402
from tests.bench.test_live_profile import profile_dict  # noqa: E402


def regime() -> Regime:
    return derive_regime(lambda b, c: 0.004 + 0.0005 * b + 1e-8 * c, lambda n: n / 4000.0,
                         Replay(2000.0, [40, 60, 2000], num_requests=12, max_probes=2),
                         max_model_len=2048)


RECORDS = [TraceRequest(i, 1000.0 * i, 1500 + 100 * i, 30 + 2000 * (i == 3), (0, 1, 2, 10 + i))
           for i in range(12)]


def test_workload_is_the_regimes_requests() -> None:
    r = regime()
    slow, fast = (cap.workload(RECORDS, r, 258, rate, seed=3) for rate in (1.0, 4.0))
    assert [p.prompt_token_ids for p in slow] == [p.prompt_token_ids for p in fast]
    assert [4 * p.send_at_s for p in fast] == pytest.approx([p.send_at_s for p in slow])
    assert all(len(p.prompt_token_ids) <= r.max_prompt_len for p in slow)
    assert [p.max_tokens for p in slow][3] == r.max_output_len  # 2030 capped at 1,024
    other = cap.workload(RECORDS, r, 258, 1.0, seed=4)  # the next probe: fresh tokens
    assert other[0].prompt_token_ids != slow[0].prompt_token_ids
    # the trace's sharing: records share hash ids 0, 1, 2 -> equal heads
    blk = round(512 * r.scale_tokens)
    n = min(3 * blk, len(slow[0].prompt_token_ids))
    assert n >= blk and slow[0].prompt_token_ids[:n] == slow[5].prompt_token_ids[:n]


def test_merged_json_shape(tmp_path: Path) -> None:
    r = regime()
    (tmp_path / "regime.json").write_text(r.to_json())
    (tmp_path / "disagg.json").write_text(json.dumps({"capacity_rps": [0.5, 1.0, None]}))
    (tmp_path / "colocated.json").write_text(json.dumps({"capacity_rps": [0.25, 0.5, 1.0]}))
    out = cap.merged(tmp_path)
    assert set(out) == {"s_d_ms", "tbt_slo_ms", "capacity_rps"}
    assert out["s_d_ms"] == pytest.approx(1000 * r.s_d_s)
    assert len(out["tbt_slo_ms"]) == 3
    assert out["capacity_rps"] == {"disagg": [0.5, 1.0, None], "colocated": [0.25, 0.5, 1.0],
                                   "vllm": [None, None, None]}  # not run: nulls
    assert cap.gains(out)["disagg/colocated"] == [2.0, 2.0, None]
    json.dumps(out)


def test_sim_vs_live_json_shape() -> None:
    r = regime()
    planned = cap.workload(RECORDS, r, 258, 2.0, seed=1)
    block = round(512 * r.scale_tokens)
    trace = simulated_runs.sim_trace(RECORDS, planned, block)
    assert [t.input_len for t in trace.requests] == [len(p.prompt_token_ids) for p in planned]
    assert all(len(t.hash_ids) == -(-t.input_len // block) for t in trace.requests)
    cost = live_cost_from_dict(profile_dict()).as_cost_model()
    configs = simulated_runs.sim_configs(r, block, budget=256)
    sim = {name: simulated_runs.sim_metrics(trace, r, config, cost)
           for name, config in configs.items()}
    results = [RequestResult(Outcome.OK, 10, 3, 0.1 * (i + 1), (0.01, 0.02), 0.2)
               for i in range(10)]
    live = {name: live_replays.live_metrics(results, r) for name in sim}
    metrics = sim_vs_live.compare(live, sim)
    assert set(metrics) == {f"{s}.{m}" for s in ("disagg", "colocated")
                            for m in ("ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms", "tbt_p90_ms",
                                      "tpot_mean_ms", "effective_share_slo1",
                                      "effective_share_slo2", "effective_share_slo3")}
    for m in metrics.values():
        assert set(m) == {"live", "sim", "rel_err"}
        if m["rel_err"] is not None:
            assert m["rel_err"] == pytest.approx((m["sim"] - m["live"]) / m["live"])
    assert live["disagg"]["ttft_p50_ms"] == pytest.approx(550.0)
    # (latency - ttft) / (output - 1): (0.2 - 0.1 (i + 1)) / 2 for i = 0, 1; negative ones too
    assert live["disagg"]["tpot_mean_ms"] == pytest.approx(
        1000 * sum((0.2 - 0.1 * (i + 1)) / 2 for i in range(10)) / 10)
    json.dumps({"metrics": metrics})


def test_sim_vs_live_checks_every_probe_of_a_capacity_search(tmp_path: Path) -> None:
    r = regime()
    (tmp_path / "regime.json").write_text(r.to_json())
    probes = [{"rate": 2.0, "median_ttft_ms": 100.0, "p90_ttft_ms": 300.0, "median_tbt_ms": 10.0,
               "p90_tbt_ms": 20.0, "mean_tpot_ms": 8.0},
              {"rate": 1.0, "median_ttft_ms": 90.0, "p90_ttft_ms": 200.0, "median_tbt_ms": 9.0,
               "p90_tbt_ms": 15.0}]  # an old probe without TPOT
    (tmp_path / "disagg.json").write_text(json.dumps({"probes": probes, "counters": {
        "prefix_cache_queries_total": 1000.0, "prefix_cache_hits_total": 50.0}}))
    cost = live_cost_from_dict(profile_dict()).as_cost_model()
    check = simulated_runs.capacity_check(tmp_path, r, RECORDS, cost, budget=256, vocab_size=258)
    assert set(check) == {"disagg"}  # no colocated.json: not checked
    rows = check["disagg"]["probes"]
    assert [row["rate"] for row in rows] == [1.0, 2.0]  # by rate
    assert "tpot_mean_ms" not in rows[0] and "tpot_mean_ms" in rows[1]
    assert rows[1]["tbt_p50_ms"]["live"] == 10.0
    m = rows[1]["ttft_p90_ms"]
    assert m["rel_err"] == pytest.approx((m["sim"] - 300.0) / 300.0)
    assert check["disagg"]["hit_share"]["live"] == pytest.approx(0.05)
    assert 0.0 <= check["disagg"]["hit_share"]["sim"] <= 1.0
    # the same probe simulated on its own gives the same numbers
    block = round(512 * r.scale_tokens)
    trace = simulated_runs.sim_trace(RECORDS, cap.workload(RECORDS, r, 258, 2.0, seed=0), block)
    alone = simulated_runs.sim_metrics(trace, r, simulated_runs.sim_configs(r, block, 256)["disagg"],
                                    cost)
    assert rows[1]["tbt_p50_ms"]["sim"] == pytest.approx(alone["tbt_p50_ms"])
    assert 0.0 <= rows[1]["prefill_busy_share"] <= 1.0
    assert "implied_decode_factor" not in rows[0]  # no live TPOT to match
    # the implied factor: the simulated mean TPOT at it is the probe's live 8.0 ms
    factor = rows[1]["implied_decode_factor"]
    config = simulated_runs.sim_configs(r, block, 256)["disagg"]
    at = dataclasses.replace(live_cost_from_dict(profile_dict()), decode_contention=factor)
    tpot = 1000 * simulated_runs.sim_tpot_mean_s(simulate(config, trace, at.as_cost_model()).states)
    assert 0.5 < factor < 8.0 and tpot == pytest.approx(8.0, rel=2e-3)
    json.dumps(check)
    other = tmp_path / "other"
    other.mkdir()
    (other / "regime.json").write_text(derive_regime(
        lambda b, c: 0.008, lambda n: n / 4000.0,
        Replay(2000.0, [40], num_requests=12, max_probes=2), max_model_len=2048).to_json())
    with pytest.raises(SystemExit, match="not this out-dir's regime"):
        simulated_runs.capacity_check(other, r, RECORDS, cost, budget=256, vocab_size=258)


def test_sim_vs_live_diagnostics() -> None:
    r = regime()
    block = round(512 * r.scale_tokens)
    trace = simulated_runs.sim_trace(RECORDS, cap.workload(RECORDS, r, 258, 2.0, seed=0), block)
    config = simulated_runs.sim_configs(r, block, 256)["disagg"]
    cost = live_cost_from_dict(profile_dict())
    diag = simulated_runs.diagnostics(trace, config, cost)
    assert set(diag) == {"hit_share", "tpot_mean_ms", "tbt_p50_elasticity"}
    # RECORDS share hash ids 0, 1, 2: later prompts reuse their head from the store
    assert diag["hit_share"] > 0
    # slower decode steps never make the TBT smaller; at least proportionally larger here
    assert diag["tbt_p50_elasticity"] >= 1.0 - 1e-9
    assert "tbt_p50_elasticity" not in simulated_runs.diagnostics(
        trace, config, None)  # the paper's cost model: no decode factor to vary


def test_capacities_from_probes_is_below_the_first_failure() -> None:
    probes = [{"rate": 0.8, "shares": [0.3, 0.6, 0.95]}, {"rate": 0.4, "shares": [0.5, 1.0, 1.0]},
              {"rate": 0.2, "shares": [0.95, 1.0, 1.0]}, {"rate": 1.6, "shares": [0.0, 0.0, 0.5]},
              {"rate": 1.2, "shares": [0.0, 0.0, 0.92]}]
    assert cap.capacities_from(probes, 3) == [0.2, 0.4, 1.2]
    assert cap.capacities_from(probes[:2], 3) == [None, 0.4, 0.8]


def test_only_the_disaggregated_pair_rejects_and_on_the_regimes_slos() -> None:
    """The cluster TOML each kvcake system is served with: the disaggregated pair's Conductor
    admits on the regime's TTFT SLO and its loosest TBT SLO (`--disagg-admission`), the
    colocated pair never rejects; `pin` writes pin_workers, None leaves the cluster default."""
    import tomllib

    import capacity_systems

    r = regime()
    args = cap.parse_args(["--out-dir", "/nonexistent-kvcake-dir"])
    disagg = tomllib.loads(capacity_systems.kvcake_toml("disagg", args, 25010, None, r, pin=True))
    assert disagg["conductor"] == {"admission": "early", "policy": "global_cache",
                                   "ttft_slo_s": pytest.approx(r.ttft_slo_s),
                                   "tbt_slo_s": pytest.approx(max(r.tbt_slos_ms) / 1000.0)}
    assert disagg["pin_workers"] is True
    assert [w["role"] for w in disagg["workers"]] == ["prefill", "decode"]
    colocated = tomllib.loads(capacity_systems.kvcake_toml("colocated", args, 25020, 64, r))
    assert colocated["conductor"] == {"admission": "none", "policy": "colocated"}
    assert "pin_workers" not in colocated and colocated["engine"]["max_num_batched_tokens"] == 64
    off = cap.parse_args(["--out-dir", "/nonexistent-kvcake-dir", "--disagg-admission", "none"])
    assert tomllib.loads(capacity_systems.kvcake_toml("disagg", off, 25010, None, r))[
        "conductor"] == {"admission": "none", "policy": "global_cache"}
    # the simulator's systems are the same
    configs = simulated_runs.sim_configs(r, 64, 256, "early")
    assert (configs["disagg"].admission, configs["colocated"].admission) == ("early", "none")
    assert {c.prefill_speed_weight for c in configs.values()} == {0.0}  # the fitted predictions
    learned = simulated_runs.sim_configs(r, 64, 256, "early", prefill_speed_weight=0.2)
    assert {c.prefill_speed_weight for c in learned.values()} == {0.2}  # both pairs, as live
    assert configs["disagg"].tbt_slo_ms == max(r.tbt_slos_ms)


def test_a_capacity_check_simulates_the_probes_with_their_speed_weight(tmp_path: Path) -> None:
    """A search run with --prefill-speed-weight records it; the check's simulated probes run
    with it (a file without it ran before the flag: 0)."""
    r = regime()
    (tmp_path / "regime.json").write_text(r.to_json())
    probe = {"rate": 4.0, "median_ttft_ms": 100.0, "p90_ttft_ms": 300.0, "median_tbt_ms": 10.0,
             "p90_tbt_ms": 20.0}
    slow = profile_dict()  # prefills started while the host decodes take 12x the fit
    slow["live"]["contention"] = {"decode": 1.0, "prefill": 1.0,  # type: ignore[index]
                                  "prefill_decode_busy": 12.0}
    cost = live_cost_from_dict(slow).as_cost_model()
    block = round(512 * r.scale_tokens)
    trace = simulated_runs.sim_trace(RECORDS, cap.workload(RECORDS, r, 258, 4.0, seed=0), block)
    ttft_p90: dict[float, float] = {}
    for weight in (0.0, 0.5):
        config = simulated_runs.sim_configs(r, block, 256, "early", weight)["disagg"]
        ttft_p90[weight] = simulated_runs.sim_metrics(trace, r, config, cost)["ttft_p90_ms"]
    assert ttft_p90[0.0] != ttft_p90[0.5]  # the learned speed changes this run
    for recorded, weight in (({}, 0.0), ({"prefill_speed_weight": 0.5}, 0.5)):
        (tmp_path / "disagg.json").write_text(json.dumps(
            {"probes": [probe], "admission": "early"} | recorded))
        check = simulated_runs.capacity_check(tmp_path, r, RECORDS, cost, budget=256,
                                              vocab_size=258)
        assert check["disagg"]["probes"][0]["ttft_p90_ms"]["sim"] == pytest.approx(
            ttft_p90[weight])
