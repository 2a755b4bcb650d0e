"""benchmarks/replay_env.py: what a live replay ran on, parsed from made-up /proc text (exact
arithmetic); live_replays' `extras` lands in the live file's runs; sim_vs_live's new flags
refused by name when bad. No servers, no live runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import live_replays  # noqa: E402
import replay_env  # noqa: E402
import sim_vs_live  # noqa: E402

STAT_0 = """cpu  100 0 50 800 10 0 0 40 0 0
cpu0 60 0 20 400 5 0 0 15 0 0
cpu1 40 0 30 400 5 0 0 25 0 0
intr 12345
"""
STAT_1 = """cpu  160 0 70 860 10 0 0 100 0 0
cpu0 100 0 30 430 5 0 0 35 0 0
cpu1 60 0 40 430 5 0 0 65 0 0
intr 12399
"""


def task_line(comm: str, state: str, utime: int, stime: int, cpu: int) -> str:
    """A /proc/PID/stat line: pid (comm) state, then fields 4..52 (14/15 utime/stime, 39 CPU)."""
    rest = ["0"] * 49  # fields 4 .. 52
    rest[14 - 4], rest[15 - 4], rest[39 - 4] = str(utime), str(stime), str(cpu)
    return f"4242 ({comm}) {state} " + " ".join(rest) + "\n"


def test_proc_stat_delta_shares_and_steal() -> None:
    d = replay_env.stat_delta(replay_env.parse_proc_stat(STAT_0),
                              replay_env.parse_proc_stat(STAT_1))
    assert set(d) == {"cpu", "cpu0", "cpu1"}
    # all CPUs: +60 user, +20 system, +60 idle, +60 steal = 200 ticks
    assert d["cpu"]["ticks"] == 200
    assert d["cpu"]["user"] == 0.3 and d["cpu"]["steal"] == 0.3 and d["cpu"]["idle"] == 0.3
    assert d["cpu"]["system"] == 0.1 and d["cpu"]["iowait"] == 0.0
    assert d["cpu1"]["steal"] == 40 / 100 and d["cpu0"]["steal"] == 20 / 100
    assert sum(v for k, v in d["cpu"].items() if k != "ticks") == pytest.approx(1.0)


def test_proc_stat_refuses_what_is_not_it() -> None:
    with pytest.raises(ValueError, match="no 'cpu' line"):
        replay_env.parse_proc_stat("intr 1\n")
    with pytest.raises(ValueError, match="went backwards"):
        replay_env.stat_delta(replay_env.parse_proc_stat(STAT_1),
                              replay_env.parse_proc_stat(STAT_0))


def test_cpu_mhz() -> None:
    text = "processor\t: 0\ncpu MHz\t\t: 2596.142\n\nprocessor\t: 1\ncpu MHz\t\t: 3100.5\n"
    assert replay_env.parse_cpu_mhz(text) == [2596.142, 3100.5]
    assert replay_env.parse_cpu_mhz("processor : 0\n") == []


def test_task_stat_fields_count_from_the_last_paren() -> None:
    st = replay_env.parse_task_stat(task_line("py (worker) x", "R", 120, 30, 1))
    assert st == replay_env.TaskStat("R", 1, 150)
    with pytest.raises(ValueError, match="needs 39"):
        replay_env.parse_task_stat("1 (a) R 0 0\n")
    assert replay_env.parse_schedstat("5000000000 1250000000 77\n") == (5_000_000_000,
                                                                        1_250_000_000)


def test_placement_credits_ticks_to_the_cpu_seen_and_same_cpu_share() -> None:
    T = replay_env.TaskStat
    decode, prefill = replay_env.Placement(), replay_env.Placement()
    # sample 0 sets the baselines (no gain)
    decode.sample({1: T("R", 0, 10), 2: T("S", 1, 5)})
    prefill.sample({7: T("R", 1, 50)})
    # sample 1: decode's thread 1 +3 on CPU 0, thread 2 +1 on CPU 1; prefill +4 on CPU 0
    decode.sample({1: T("R", 0, 13), 2: T("S", 1, 6)})
    prefill.sample({7: T("R", 0, 54)})
    # sample 2: decode +2 on CPU 1; prefill idle
    decode.sample({1: T("R", 1, 15), 2: T("S", 1, 6)})
    prefill.sample({7: T("S", 0, 54)})
    # sample 3: decode +1 on CPU 1, prefill +2 on CPU 0
    decode.sample({1: T("R", 1, 16), 2: T("S", 1, 6)})
    prefill.sample({7: T("R", 0, 56)})
    assert decode.ticks_by_cpu == {0: 3, 1: 4}
    assert prefill.ticks_by_cpu == {0: 6}
    assert decode.busiest_cpu == [None, 0, 1, 1]
    assert prefill.busiest_cpu == [None, 0, None, 0]
    # both busy in samples 1 and 3: same CPU in 1 of 2
    assert replay_env.same_cpu_share(decode.busiest_cpu, prefill.busiest_cpu) == 0.5
    assert replay_env.same_cpu_share([None], [0]) is None


def test_run_queue_wait_share() -> None:
    before = {1: (1_000_000_000, 0), 2: (0, 0)}
    after = {1: (3_000_000_000, 500_000_000), 2: (1_000_000_000, 500_000_000),
             3: (0, 0)}  # a thread born during the replay counts from 0
    w = replay_env.wait_share(before, after)
    assert w == {"run_s": 3.0, "wait_s": 1.0, "wait_share": 0.25}
    assert replay_env.wait_share({}, {})["wait_share"] is None


def test_gemm_table_measured_or_loaded(tmp_path: Path) -> None:
    (tmp_path / "linear-abc-t1.json").write_text('{"64x64": ["aten"]}')
    before = replay_env.table_states(tmp_path)
    (tmp_path / "linear-abc-t2.json").write_text("{}")  # written at start-up
    after = replay_env.table_states(tmp_path)
    assert replay_env.table_use(before, after) == {"linear-abc-t1.json": "loaded",
                                                   "linear-abc-t2.json": "measured"}
    (tmp_path / "linear-abc-t1.json").write_text('{"64x64": ["onednn"]}')  # rewritten
    assert replay_env.table_use(before, replay_env.table_states(tmp_path))[
        "linear-abc-t1.json"] == "measured"
    assert len(before["linear-abc-t1.json"]) == 16


def test_step_split_against_client_gaps() -> None:
    steps = [{"t0": 0.5, "t1": 0.6, "t2": 0.6, "cpu": 0.1, "rows": [["a", 5]]},  # warm-up
             {"t0": 1.0, "t1": 1.020, "t2": 1.021, "cpu": 0.010, "rows": [["a", 5]]},
             {"t0": 1.03, "t1": 1.06, "t2": 1.061, "cpu": 0.020, "rows": [["a", 6], ["b", 3]]},
             {"t0": 1.1, "t1": 1.1, "t2": 1.1, "cpu": 0.0, "rows": []}]  # idle
    out = replay_env.step_split(steps, [0.030, 0.040], begun=1.0)
    assert out["steps"] == 2 and out["batch_mean"] == 1.5
    assert out["step_wall_ms_mean"] == pytest.approx(25.0)
    assert out["step_cpu_ms_p50"] == pytest.approx(15.0)
    assert out["wall_over_cpu"] == pytest.approx(50 / 30)
    assert out["client_gap_ms_mean"] == pytest.approx(35.0)
    assert out["gap_outside_step_ms"] == pytest.approx(10.0)
    assert replay_env.step_split(steps, [], begun=5.0) == {"steps": 0}


def test_extras_land_in_the_live_file_runs(tmp_path: Path) -> None:
    from tests.bench.test_live_replays import REPLAY_A, REPLAY_B

    replays = iter([REPLAY_A, REPLAY_B])
    envs = iter([{"steal": 0.1}, {"steal": 0.2}])
    path = tmp_path / "live.json"
    live_replays.replay_file(live_replays.ReplayFile(path, 1.0, ("disagg",), 2),
                             lambda _s: next(replays), lambda rs: {"n": float(len(rs))},
                             when=lambda: {"at": "t"}, extras=lambda: next(envs))
    runs = json.loads(path.read_text())["runs"]["disagg"]
    assert [r["env"] for r in runs] == [{"steal": 0.1}, {"steal": 0.2}]
    assert runs[0]["before"] == {"at": "t"}


@pytest.mark.parametrize("argv, needle", [
    (["--pin", "yes"], "--pin"),
    (["--live-only", "--sim-only"], "--live-only and --sim-only"),
])
def test_bad_new_flags_refused_by_name(argv: list[str], needle: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sim_vs_live.main(["--out-dir", "/nonexistent-kvcake-dir", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_invocation_spread_rows_and_correlation() -> None:
    import invocation_spread

    assert invocation_spread.pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert invocation_spread.pearson([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert invocation_spread.pearson([1.0, 2.0], [1.0, 2.0]) is None  # under 3 points
    assert invocation_spread.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # constant

    def run(at: str, steal: float, step_ms: float, pin: bool) -> dict[str, object]:
        return {"before": {"at": f"2026-12-02 {at} UTC"}, "env": {
            "pin_workers": pin, "load_before": [1.5, 1.0, 1.0], "mhz_before": [2000.0],
            "mhz_after": [3000.0],
            "gemm_tables": {"linear-k-t1.json": {"sha256_16": "abcdef0123456789",
                                                 "before": None, "use": "measured"}},
            "workers": {"decode:2": {"role": "decode", "affinity": [1], "ran_on_ticks": {"1": 9},
                                     "run_queue": {"wait_share": 0.25}}},
            "proc_stat": {"cpu": {"steal": steal, "idle": 0.5}},
            "decode_steps": {"step_wall_ms_mean": step_ms}}}

    requests = [{"gaps_s": [0.010, 0.030]}, {"gaps_s": []}, {"gaps_s": [0.020]}]
    live = {"runs": {"disagg": [run("10:00:00", 0.0, 20.0, False), run("10:05:00", 0.1, 25.0, True),
                                run("10:10:00", 0.2, 30.0, False)]},
            "requests": {"disagg": [requests] * 3}}
    rows = invocation_spread.rows_of("inv", live)
    assert [r["name"] for r in rows] == ["inv#1", "inv#2", "inv#3"]
    r = rows[0]
    assert r["at"] == "10:00:00" and r["table"] == "measured:abcdef" and r["table_measured"] == 1.0
    assert r["gap_mean_ms"] == pytest.approx(20.0)  # gaps 10, 30, 20 ms
    assert r["mhz_mean"] == 2500.0 and r["decode_wait_share"] == 0.25
    assert r["prefill_wait_share"] is None and r["decode_affinity"] == [1]
    corr = invocation_spread.correlations(rows)["step_wall_mean_ms"]
    assert corr["steal_share"] == pytest.approx(1.0)
    assert corr["table_measured"] is None  # constant


def test_gemm_table_ab_reads_a_workers_log_line_and_refuses_bad_tables(tmp_path: Path) -> None:
    import argparse

    import gemm_table_ab

    log = ("2026-12-02 12:32:07,989 INFO kvcake.engine.engine: engine: decode attention kernel; "
           "linear backends (rows 1 | 2 | 3-4 | 5-8 | 9-64 | 65-512 | 513+) "
           "{'768x512': 'aten|aten_t|onednn', '512x512': 'mkl_gemv|aten_t|aten'}\n"
           "2026-12-02 12:32:22,024 INFO kvcake.server.cluster.backend: worker decode-1 joined\n")
    assert gemm_table_ab.tables_from_log(log) == [
        {"768x512": ["aten", "aten_t", "onednn"], "512x512": ["mkl_gemv", "aten_t", "aten"]}]
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH"):
        gemm_table_ab.table_arg("just-a-path.json")
    with pytest.raises(argparse.ArgumentTypeError, match="--table a: .* is not a file"):
        gemm_table_ab.table_arg(f"a={tmp_path / 'missing.json'}")
    (tmp_path / "t.json").write_text("{}")
    assert gemm_table_ab.table_arg(f"a={tmp_path / 't.json'}") == ("a", tmp_path / "t.json")


def test_append_pools_replays_across_invocations(tmp_path: Path) -> None:
    from tests.bench.test_live_replays import REPLAY_A, REPLAY_B

    path = tmp_path / "live.json"
    n = lambda rs: {"n": float(len(rs))}  # noqa: E731
    live_replays.replay_file(live_replays.ReplayFile(path, 1.0, ("disagg",), 1),
                             lambda _s: REPLAY_A, n, when=lambda: {"at": "first"})
    got = live_replays.replay_file(
        live_replays.ReplayFile(path, 1.0, ("disagg",), 1, append=True), lambda _s: REPLAY_B, n,
        when=lambda: {"at": "second"})
    assert got["metrics"]["disagg"] == {"n": 8.0}  # 4 + 4 requests pooled
    assert got["replays"]["disagg"] == [{"n": 4.0}, {"n": 4.0}]
    data = json.loads(path.read_text())
    assert [r["before"]["at"] for r in data["runs"]["disagg"]] == ["first", "second"]
    assert data["repeats"] == 2 and len(data["requests"]["disagg"]) == 2
    # without append a new invocation replaces the system's replays
    got = live_replays.replay_file(live_replays.ReplayFile(path, 1.0, ("disagg",), 1),
                                   lambda _s: REPLAY_B, n)
    assert got["replays"]["disagg"] == [{"n": 4.0}]
    # another rate's file is not pooled with
    got = live_replays.replay_file(
        live_replays.ReplayFile(path, 2.0, ("disagg",), 1, append=True), lambda _s: REPLAY_A, n)
    assert got["replays"]["disagg"] == [{"n": 4.0}]


def test_append_replays_refused_with_sim_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sim_vs_live.main(["--out-dir", "/nonexistent-kvcake-dir", "--append-replays",
                          "--sim-only"])
    assert exc.value.code == 2 and "--append-replays" in capsys.readouterr().err
