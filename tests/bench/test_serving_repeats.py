"""The serving benchmark's repeat design, medians, ratios, and its wait for a server's processes."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcake.bench.hoststate import busy_share, parse_cpu_line, steal_share
from kvcake.bench.proctree import ProcessTable, parse_stat, session_pids, wait_gone
from kvcake.bench.repeats import alternating_orders, median_result, ratios, spread
from kvcake.clock import ManualClock

SUMMARY = (("probe_ttft_cold", "probe.ttft_cold_ms"), ("trace_ttft_p90", "trace.p90_ttft_ms"))


def test_alternating_orders_put_each_system_first_equally_often() -> None:
    orders = alternating_orders(["a", "b"], 4)
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    flat = [x for o in orders for x in o]
    assert "".join(flat) == "abbaabba"
    assert alternating_orders(["a", "b"], 1) == [["a", "b"]]


@pytest.mark.parametrize("labels,repeats", [(["a", "b"], 0), ([], 2), (["a", "a"], 2)])
def test_alternating_orders_reject_bad_input(labels: list[str], repeats: int) -> None:
    with pytest.raises(ValueError):
        alternating_orders(labels, repeats)


def test_spread_and_median_result_over_runs() -> None:
    runs = [{"probe": {"ttft_cold_ms": 400.0}, "trace": {"p90_ttft_ms": 900.0}},
            {"probe": {"ttft_cold_ms": 360.0}, "trace": None},
            {"probe": {"ttft_cold_ms": 380.0}, "trace": {"p90_ttft_ms": 600.0}}]
    found = spread(runs, "probe.ttft_cold_ms")
    assert found is not None
    assert (found.median, found.low, found.high, found.n) == (380.0, 360.0, 400.0, 3)
    assert found.rel_spread == pytest.approx(40.0 / 380.0)
    p90 = spread(runs, "trace.p90_ttft_ms")
    assert p90 is not None and p90.n == 2 and p90.median == 750.0
    assert spread(runs, "trace.missing") is None
    assert median_result(runs, ("probe.ttft_cold_ms", "trace.p90_ttft_ms", "x.y")) == {
        "probe": {"ttft_cold_ms": 380.0}, "trace": {"p90_ttft_ms": 750.0}}


def test_ratios_of_medians_and_missing_metrics() -> None:
    ours = {"probe": {"ttft_cold_ms": 300.0}}
    peer = {"probe": {"ttft_cold_ms": 400.0}, "trace": {"p90_ttft_ms": 0.0}}
    assert ratios(ours, peer, SUMMARY) == {"probe_ttft_cold": 0.75, "trace_ttft_p90": None}
    assert ratios(None, peer, SUMMARY) == {"probe_ttft_cold": None, "trace_ttft_p90": None}


def test_parse_stat_handles_spaces_and_parens_in_the_name() -> None:
    line = "4242 (VLLM::Engine Core) (x)) S 4200 4100 4100 0 -1 4194560 7 0 0 0"
    assert parse_stat(line) == (4242, "S", 4100, 4100)
    with pytest.raises(ValueError):
        parse_stat("garbage")


def test_session_pids_reads_proc_and_skips_zombies_and_others(tmp_path: Path) -> None:
    rows = {"10": "10 (python) S 1 10 10 0", "11": "11 (engine core) R 10 10 10 0",
            "12": "12 (dead) Z 10 10 10 0", "13": "13 (other) S 1 13 13 0"}
    for pid, stat in rows.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(stat + "\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "14").mkdir()  # exited while listing: no stat file
    assert session_pids(10, tmp_path) == [10, 11]


def test_wait_gone_waits_for_a_lingering_child_then_reports() -> None:
    clock = ManualClock()
    alive = [[101, 102], [102], [102], []]  # leader gone first, engine core lingers

    def list_pids(sid: int) -> list[int]:
        assert sid == 100
        return alive.pop(0) if len(alive) > 1 else alive[0]

    killed: list[tuple[int, int]] = []
    gone = wait_gone(100, timeout_s=60.0, poll_s=0.5,
                     processes=ProcessTable(list_pids, lambda pid, sig: killed.append((pid, sig))),
                     sleep=clock.advance, clock=clock)
    assert (gone.wait_s, gone.left_at_start, gone.killed, gone.still_alive) == (1.5, 2, 0, 0)
    assert not killed


def test_wait_gone_kills_after_the_deadline() -> None:
    clock = ManualClock()
    state = {"alive": [7, 8]}
    killed: list[tuple[int, int]] = []

    def kill(pid: int, sig: int) -> None:
        killed.append((pid, sig))
        state["alive"] = [p for p in state["alive"] if p != pid]

    gone = wait_gone(7, timeout_s=2.0, poll_s=1.0,
                     processes=ProcessTable(lambda sid: list(state["alive"]), kill),
                     sleep=clock.advance, clock=clock)
    assert killed == [(7, signal.SIGKILL), (8, signal.SIGKILL)]
    assert gone.killed == 2 and gone.still_alive == 0 and gone.wait_s == 3.0


def test_wait_gone_gives_up_on_an_unkillable_process() -> None:
    clock = ManualClock()
    gone = wait_gone(7, timeout_s=1.0, poll_s=1.0,
                     processes=ProcessTable(lambda sid: [7], lambda pid, sig: None),
                     sleep=clock.advance, clock=clock)
    assert gone.killed == 1 and gone.still_alive == 1 and gone.wait_s == 11.0


def test_cpu_busy_share_from_proc_stat_lines() -> None:
    before = parse_cpu_line("cpu  100 0 50 800 50 0 0 0 0 0")
    after = parse_cpu_line("cpu  200 0 100 1100 50 0 0 30 0 0")
    assert (before.busy, before.steal, before.total) == (150, 0, 1000)
    assert busy_share(before, after) == pytest.approx(180 / 480)
    assert steal_share(before, after) == pytest.approx(30 / 480)
    assert busy_share(before, before) is None
    with pytest.raises(ValueError):
        parse_cpu_line("cpu0 1 2 3 4")


def test_position_effect_splits_a_system_by_whether_it_ran_first() -> None:
    from kvcake.bench.repeats import position_effect
    runs = [{"order": ["k", "v"], "results": {"k": {"p": 1.0}, "v": {"p": 5.0}}},
            {"order": ["v", "k"], "results": {"k": {"p": 3.0}, "v": {"p": 4.0}}},
            {"order": ["v", "k"], "results": {"k": {"p": 5.0}, "v": {"p": None}}},
            {"order": ["k", "v"], "results": {"k": {"p": 2.0}, "v": {"p": 6.0}}}]
    assert position_effect(runs, "k", "p") == {0: 1.5, 1: 4.0}
    assert position_effect(runs, "v", "p") == {0: 4.0, 1: 5.5}
    assert position_effect(runs, "x", "p") == {}


def _result(ttft: float, busy: float | None) -> dict[str, object]:
    return {"startup_s": 5.0, "probe": {"ttft_cold_ms": ttft, "mean_tbt_ms": 10.0},
            "trace": {"median_ttft_ms": 100.0, "p90_ttft_ms": 600.0, "median_tbt_ms": 14.0,
                      "p90_tbt_ms": 20.0},
            "host_before": {"cpu_busy": busy, "mem_available_mib": 20000.0, "spin_ms": 55.0},
            "host_during": {"cpu_busy": 0.9, "steal": 0.0},
            "teardown": {"wait_s": 0.0, "left_at_start": 0, "killed": 0, "still_alive": 0}}


def test_the_benchmark_tables_print_medians_runs_and_positions(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    bench: Any = _bench_module("serving_report", monkeypatch)
    k, v = "kvcake-single:float32", "vllm:float32"
    runs = [{"repeat": 1, "order": [k, v], "results": {k: _result(380.0, 0.01),
                                                       v: _result(400.0, None)}},
            {"repeat": 2, "order": [v, k], "results": {k: _result(420.0, 0.02),
                                                       v: _result(380.0, 0.0)}}]
    for run in runs:
        run["ratios"] = bench.summary_ratios(run["results"])
    per_system = {label: [r["results"][label] for r in runs] for label in (k, v)}
    medians = {label: median_result(rs, bench.MEDIAN_PATHS)
               for label, rs in per_system.items()}
    assert bench.summary_ratios(medians)["probe_ttft_cold"] == pytest.approx(400.0 / 390.0,
                                                                              abs=1e-4)
    bench.print_table(per_system)
    bench.print_runs(runs)
    bench.print_positions(runs, [k, v])
    out = capsys.readouterr().out
    assert "| probe TTFT cold (ms) | 400.0 (380.0-420.0) | 390.0 (380.0-400.0) | 1.03 |" in out
    assert f"| {k} | probe_ttft_cold | 380.0 | 420.0 | 1.11 |" in out
    assert f"| {v} | probe_ttft_cold | 380.0 | 400.0 | 1.05 |" in out
    assert f"| 2 | {v} > {k} |" in out


def _bench_module(name: str, monkeypatch: pytest.MonkeyPatch) -> object:
    """One of benchmarks/'s modules, imported as its scripts import each other."""
    import importlib
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module(name)


def test_kvcake_bind_choices_pass_the_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kvcake-bind default passes nothing (serve's own default); the others name it; the old
    --kvcake-bind-threads is `all`."""
    import argparse
    servers: Any = _bench_module("bench_servers", monkeypatch)
    bench: Any = _bench_module("serving_vs_vllm", monkeypatch)
    single = servers.System("kvcake-single", "float32")

    def argv(bind: str, extra: str = "") -> list[str]:
        args = argparse.Namespace(model_dir=Path("m"), kvcake_threads=2, max_model_len=64,
                                  kvcake_bind=bind, kvcake_serve_args=extra)
        return servers.kvcake_command(single, args, 1, Path("."))

    assert not any("bind" in a for a in argv("default"))
    assert argv("off")[-1:] == ["--no-bind-threads"]
    assert argv("workers")[-2:] == ["--bind-threads", "--no-bind-engine-thread"]
    assert argv("all")[-2:] == ["--bind-threads", "--bind-engine-thread"]
    # --kvcake-serve-args: more serve flags after the binding ones, split as a shell would
    assert argv("off", "--engine-process --switch-interval-ms 0.5")[-4:] == [
        "--no-bind-threads", "--engine-process", "--switch-interval-ms", "0.5"]
    monkeypatch.setattr(sys, "argv", ["serving_vs_vllm.py", "--kvcake-bind-threads"])
    assert bench.parse_args().kvcake_bind == "all"
    assert servers.session_run_ns(None) is None
