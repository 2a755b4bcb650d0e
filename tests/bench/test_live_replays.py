"""benchmarks/live_replays.py and sim_vs_live.py's --live-repeats: the live metrics over the
pooled requests of N replays, each replay's value, the replays' range and spread, whether the
simulated value lies in that range; bad --live-repeats refused by name. Made-up requests, no
servers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import live_replays  # noqa: E402
import sim_vs_live  # noqa: E402

from kvcake.bench.stats import Outcome, RequestResult  # noqa: E402
from tests.bench.test_capacity_bench_json import regime  # noqa: E402

# regime(): TTFT SLO 5.376 s, TBT SLOs 18.94 / 37.88 / 56.82 ms


def request(ttft_s: float, gap_s: float) -> RequestResult:
    """Two output tokens, one gap: its TBT and its TPOT are both the gap."""
    return RequestResult(Outcome.OK, 10, 2, ttft_s, (gap_s,), ttft_s + gap_s)


# A: TBT 10 / 12 / 14 / 100 ms (the last misses every SLO): shares 3/4 at each SLO.
REPLAY_A = [request(0.1, 0.010), request(0.2, 0.012), request(0.3, 0.014), request(0.4, 0.100)]
# B: TBT 16 / 30 / 50 / 18 ms, the last TTFT 8 s (over the TTFT SLO): shares 1/4, 2/4, 3/4.
REPLAY_B = [request(0.5, 0.016), request(0.6, 0.030), request(0.7, 0.050), request(8.0, 0.018)]


def pooled() -> dict[str, Any]:
    r = regime()
    return live_replays.pool([REPLAY_A, REPLAY_B], lambda rs: live_replays.live_metrics(rs, r))


def test_metrics_are_over_the_pooled_requests() -> None:
    got = pooled()
    m = got["metrics"]
    # TTFT ms, pooled sorted 100..700, 8000: p50 (400 + 500) / 2; p90 at 6.3: 700 + 0.3 x 7300
    assert m["ttft_p50_ms"] == pytest.approx(450.0)
    assert m["ttft_p90_ms"] == pytest.approx(2890.0)
    # TBT ms, pooled sorted 10 12 14 16 18 30 50 100: p50 17; p90 at 6.3: 50 + 0.3 x 50
    assert m["tbt_p50_ms"] == pytest.approx(17.0)
    assert m["tbt_p90_ms"] == pytest.approx(65.0)
    assert m["tpot_mean_ms"] == pytest.approx(250.0 / 8)
    # shares over all 8 requests: (3 + 1) / 8, (3 + 2) / 8, (3 + 3) / 8
    assert [m[f"effective_share_slo{k}"] for k in (1, 2, 3)] == pytest.approx([0.5, 0.625, 0.75])


def test_each_replay_keeps_its_own_value() -> None:
    a, b = pooled()["replays"]
    assert (a["ttft_p50_ms"], b["ttft_p50_ms"]) == pytest.approx((250.0, 650.0))
    assert (a["ttft_p90_ms"], b["ttft_p90_ms"]) == pytest.approx((370.0, 5810.0))
    assert (a["tbt_p50_ms"], b["tbt_p50_ms"]) == pytest.approx((13.0, 24.0))
    assert (a["tbt_p90_ms"], b["tbt_p90_ms"]) == pytest.approx((74.2, 44.0))
    assert [a[f"effective_share_slo{k}"] for k in (1, 2, 3)] == pytest.approx([0.75] * 3)
    assert [b[f"effective_share_slo{k}"] for k in (1, 2, 3)] == pytest.approx([0.25, 0.5, 0.75])
    # pooling is not averaging the replays' percentiles: (74.2 + 44) / 2 = 59.1, pooled 65
    assert pooled()["metrics"]["tbt_p90_ms"] != pytest.approx((74.2 + 44.0) / 2)


def test_range_spread_and_whether_the_simulator_lies_in_it() -> None:
    got = pooled()
    live = {"disagg": got["metrics"]}
    sim = {"disagg": {**got["metrics"], "ttft_p50_ms": 600.0, "ttft_p90_ms": 6000.0,
                      "tbt_p50_ms": 18.0, "effective_share_slo1": 0.0}}
    m = live_replays.annotate(sim_vs_live.compare(live, sim), {"disagg": got["replays"]})
    ttft = m["disagg.ttft_p50_ms"]
    assert ttft["live_replays"] == pytest.approx([250.0, 650.0])
    assert (ttft["live_min"], ttft["live_max"]) == pytest.approx((250.0, 650.0))
    assert ttft["live_spread"] == pytest.approx(400.0 / 450.0)
    assert ttft["rel_err"] == pytest.approx(150.0 / 450.0)
    assert ttft["sim_in_live_range"] is True and ttft["within_target"] is False
    p90 = m["disagg.ttft_p90_ms"]
    assert p90["sim_in_live_range"] is False  # 6,000 ms above both replays (370, 5,810)
    assert p90["live_spread"] == pytest.approx((5810.0 - 370.0) / 2890.0)
    tbt = m["disagg.tbt_p50_ms"]
    assert tbt["rel_err"] == pytest.approx(1.0 / 17.0)
    assert tbt["within_target"] is True and tbt["sim_in_live_range"] is True
    share1, share2 = m["disagg.effective_share_slo1"], m["disagg.effective_share_slo2"]
    assert share1["live_spread"] == pytest.approx(0.5 / 0.5)  # 0.25 .. 0.75, pooled 0.5
    assert share1["sim_in_live_range"] is False and share1["within_target"] is False
    assert share2["live_spread"] == pytest.approx(0.25 / 0.625)
    share3 = m["disagg.effective_share_slo3"]  # both replays 0.75: a range of one point
    assert share3["live_spread"] == 0.0 and share3["sim_in_live_range"] is True
    floor = live_replays.noise_floor(m)
    assert floor["disagg.tbt_p50_ms"] == pytest.approx(11.0 / 17.0)
    assert set(floor) == set(m)


def test_metrics_without_replays_keep_the_old_shape() -> None:
    """A live file from before --live-repeats: no replays, no range keys (only within_target)."""
    live = {"disagg": {"ttft_p50_ms": 100.0, "effective_share_slo1": 0.0}}
    sim = {"disagg": {"ttft_p50_ms": 120.0, "effective_share_slo1": 0.5}}
    m = live_replays.annotate(sim_vs_live.compare(live, sim), {})
    assert m["disagg.ttft_p50_ms"] == {"live": 100.0, "sim": 120.0,
                                       "rel_err": pytest.approx(0.2), "within_target": False}
    assert m["disagg.effective_share_slo1"]["within_target"] is None  # live 0: no rel_err
    assert live_replays.noise_floor(m) == {}


def test_pool_needs_a_replay() -> None:
    with pytest.raises(ValueError, match="at least one replay"):
        live_replays.pool([], lambda rs: {})


def test_request_records_round_trip() -> None:
    failed = RequestResult(Outcome.ERROR, 7, 0, None, (), None, "HTTP 500")
    for result in (*REPLAY_B, failed):
        assert live_replays.from_json(live_replays.to_json(result)) == result


@pytest.mark.parametrize("bad", ["0", "-2", "two", "2.5", ""])
def test_bad_live_repeats_is_refused_by_name(bad: str, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    with pytest.raises(SystemExit) as exc:
        sim_vs_live.main(["--live-repeats", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--live-repeats" in err and ">= 1" in err


def test_live_repeats_accepts_a_count() -> None:
    assert live_replays.repeats_arg("5") == 5
    assert live_replays.DEFAULT_REPEATS == 3


def test_replay_file_pools_each_system_and_keeps_the_others(tmp_path: Path) -> None:
    """Replayed systems: `repeats` replays each, pooled, written with their request records;
    a system not replayed keeps its earlier figures from a file of the same rate."""
    r = regime()
    path = tmp_path / "live.json"
    path.write_text(json.dumps({"rate": 0.5, "metrics": {"colocated": {"ttft_p50_ms": 7.0}},
                                "replays": {"colocated": [{"ttft_p50_ms": 7.0}]}}))
    served = iter([REPLAY_A, REPLAY_B])
    calls: list[str] = []

    def replay_once(system: str) -> list[RequestResult]:
        calls.append(system)
        return next(served)

    got = live_replays.replay_file(live_replays.ReplayFile(path, 0.5, ("disagg",), 2),
                                   replay_once, lambda rs: live_replays.live_metrics(rs, r),
                                   when=lambda: {"at": "t"})
    assert calls == ["disagg", "disagg"]
    assert got["metrics"]["disagg"]["ttft_p50_ms"] == pytest.approx(450.0)
    assert [m["ttft_p50_ms"] for m in got["replays"]["disagg"]] == pytest.approx([250.0, 650.0])
    assert got["metrics"]["colocated"] == {"ttft_p50_ms": 7.0}  # reused, not replayed
    saved = json.loads(path.read_text())
    assert saved["repeats"] == 2 and saved["rate"] == 0.5
    assert len(saved["runs"]["disagg"]) == 2
    assert [live_replays.from_json(x) for x in saved["requests"]["disagg"][1]] == REPLAY_B
    # read back without replaying: the same figures
    again = live_replays.replay_file(
        live_replays.ReplayFile(path, 0.5, ("disagg",), 2, replay=False), replay_once,
        lambda rs: live_replays.live_metrics(rs, r))
    assert again == json.loads(json.dumps(got)) and len(calls) == 2
    # a file of another rate is not reused
    other = live_replays.replay_file(
        live_replays.ReplayFile(path, 0.25, ("disagg",), 2, replay=False), replay_once,
        lambda rs: {})
    assert other == {"metrics": {}, "replays": {}, "runs": {}}


def test_a_check_refuses_live_replays_of_another_admission() -> None:
    def runs(*admissions: str | None) -> dict[str, object]:
        return {"runs": {"disagg": [{"env": {} if a is None else {"admission": a}}
                                    for a in admissions],
                         "colocated": [{"env": {"admission": "none"}}]}}

    live_replays.check_admission(runs("early", "early"), "early")
    live_replays.check_admission(runs(None), "none")  # recorded before the flag: none
    live_replays.check_admission(None, "early")  # no second rate
    with pytest.raises(SystemExit, match="ran with admission none, not early: pass "
                                         "--disagg-admission to match"):
        live_replays.check_admission(runs(None), "early")
    with pytest.raises(SystemExit, match="ran with admission early, not none"):
        live_replays.check_admission(runs("early"), "none")
    with pytest.raises(SystemExit, match="admissions early and none, mixed in one file"):
        live_replays.check_admission(runs(None, "early"), "early")


def test_a_check_refuses_live_replays_of_another_speed_weight() -> None:
    def runs(disagg: list[float | None], colocated: list[float | None]) -> dict[str, object]:
        def env(w: float | None) -> dict[str, object]:
            return {"env": {} if w is None else {"prefill_speed_weight": w}}
        return {"runs": {"disagg": [env(w) for w in disagg],
                         "colocated": [env(w) for w in colocated]}}

    live_replays.check_speed_weight(runs([0.2, 0.2], [0.2]), 0.2)
    live_replays.check_speed_weight(runs([None], [None]), 0.0)  # recorded before the flag: 0
    live_replays.check_speed_weight(None, 0.2)  # no second rate
    with pytest.raises(SystemExit, match="ran with prefill_speed_weight 0, not 0.2: pass "
                                         "--prefill-speed-weight to match"):
        live_replays.check_speed_weight(runs([None], [None]), 0.2)
    with pytest.raises(SystemExit, match="ran with prefill_speed_weight 0.2, not 0:"):
        live_replays.check_speed_weight(runs([], [0.2]), 0.0)  # the colocated pair's too
    with pytest.raises(SystemExit, match="prefill_speed_weight 0 and 0.2, not 0.2"):
        live_replays.check_speed_weight(runs([None, 0.2], []), 0.2)  # mixed in one file
    with pytest.raises(SystemExit, match="prefill_speed_weight 0 and 0.2, not 0:"):
        live_replays.check_speed_weight(runs([0.0], [0.2]), 0.0)


@pytest.mark.parametrize(("fit_rate", "replay_rates", "expected"), [
    (None, "both", [(0.8, "live.json", True)]),
    (0.4, "both", [(0.8, "live.json", True), (0.4, "live_fit.json", True)]),
    (0.4, "rate", [(0.8, "live.json", True), (0.4, "live_fit.json", False)]),
    (0.4, "fit-rate", [(0.8, "live.json", False), (0.4, "live_fit.json", True)]),
    (0.8, "both", [(0.8, "live.json", True)]),  # the fit rate is the rate: replayed once
])
def test_check_files_replays_each_rate_once(fit_rate: float | None, replay_rates: str,
                                            expected: list[tuple[float, str, bool]]) -> None:
    calls: list[tuple[float, str, bool]] = []

    def live_at(rate: float, name: str, replay: bool) -> dict[str, Any]:
        calls.append((rate, name, replay))
        return {"metrics": {name: {}}, "replays": {}}

    live, fit = live_replays.check_files(0.8, fit_rate, replay_rates, live_at)
    assert calls == expected
    assert live == {"metrics": {"live.json": {}}, "replays": {}}
    if fit_rate is None:
        assert fit is None
    elif fit_rate == 0.8:
        assert fit is live
    else:
        assert fit == {"metrics": {"live_fit.json": {}}, "replays": {}}


def test_terms_after_needs_the_same_step_traces_at_the_runs_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after = tmp_path / "gaps-disagg-pinon.json", tmp_path / "after"
    after.mkdir()
    before.write_text("{}")
    argv = ["--out-dir", str(tmp_path), "--host-terms", str(before), "--terms-after", str(after)]
    with pytest.raises(SystemExit) as exc:
        sim_vs_live.parse_args(argv)
    assert exc.value.code == 2
    assert f"--terms-after: {after / before.name} not found" in capsys.readouterr().err
    (after / before.name).write_text("{}")
    assert sim_vs_live.parse_args(argv).terms_after == after


def test_a_bracket_needs_each_refit_at_both_ends(tmp_path: Path) -> None:
    import live_profile_fit

    after = tmp_path / "after"
    after.mkdir()
    (tmp_path / "profile.json").write_text(json.dumps({"prefill": {"p": 1.0}}))
    (tmp_path / live_profile_fit.DECODE_REFIT).write_text(json.dumps({"decode": {"d": 1.0}}))
    config = {hf: 8 for hf in live_profile_fit.SHAPE_KEYS.values()}
    with pytest.raises(SystemExit, match=f"{after / live_profile_fit.DECODE_REFIT} not found"):
        live_profile_fit.live_profile(tmp_path, config, 1e9, refits_dir=after)
    (after / live_profile_fit.DECODE_REFIT).write_text(json.dumps({"decode": {"d": 2.0}}))
    at_end = live_profile_fit.live_profile(tmp_path, config, 1e9, refits_dir=after)
    assert at_end["decode"] == {"d": 2.0} and at_end["prefill"] == {"p": 1.0}
    assert live_profile_fit.live_profile(tmp_path, config, 1e9)["decode"] == {"d": 1.0}
