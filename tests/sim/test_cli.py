"""`kvcake simulate`, `kvcake reproduce` and `kvcake trace`: JSON fields and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcake.cli import main
from kvcake.sim.tracegen import TraceGenConfig, generate_trace


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    generate_trace(TraceGenConfig(num_requests=80, rate_per_s=4.0, seed=3)).write(path)
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json_has_the_required_fields(small_trace: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "records.jsonl"
    plot = tmp_path / "run.png"
    code, out, _ = _run(["simulate", "--trace", str(small_trace), "--prefill", "2", "--decode",
                         "2", "--policy", "global_cache", "--json", "--records", str(records),
                         "--plot", str(plot)], capsys)
    assert code == 0
    summary = json.loads(out)
    for key in ("requests", "completed", "rejected", "effective_request_capacity",
                "cache_hit_rate", "prefill_compute_s", "transfer_bytes"):
        assert key in summary
    for key in ("ttft_s", "tbt_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert summary["requests"] == 80
    lines = records.read_text().splitlines()
    assert len(lines) == 80
    first = json.loads(lines[0])
    for key in ("arrival_s", "prefill_instance", "decode_instance", "prefix_reused_tokens",
                "fetched_tokens", "ttft_s", "tbt_s", "output_tokens", "rejected",
                "reject_reason"):
        assert key in first
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_colocated_chunked(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["simulate", "--trace", str(small_trace), "--prefill", "1", "--decode",
                         "1", "--policy", "colocated", "--chunked-prefill", "--json"], capsys)
    assert code == 0
    summary = json.loads(out)
    assert summary["decode_instances"] == 2 and summary["transfer_bytes"] == 0
    assert summary["rejected"] == 0


@pytest.mark.parametrize("argv, needle", [
    (["--prefill", "0"], "--prefill"),
    (["--policy", "best"], "--policy"),
    (["--speed", "-1"], "--speed"),
    (["--local-cache-tokens", "lots"], "--local-cache-tokens"),
    (["--chunk-budget-tokens", "100"], "chunk_budget_tokens"),
])
def test_bad_flags_exit_2_with_one_line(argv: list[str], needle: str, small_trace: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["simulate", "--trace", str(small_trace), *argv], capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert needle in err


def test_unknown_flag_exits_2(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Unknown flags are reported by the top-level `kvcake` parser (usage line + error line).
    code, out, err = _run(["simulate", "--trace", str(small_trace), "--nosuchflag"], capsys)
    assert code == 2 and out == "" and "--nosuchflag" in err


def test_missing_trace_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["simulate", "--trace", str(tmp_path / "nope.jsonl")], capsys)
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1


def test_malformed_trace_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                   "{not json\n")
    code, _, err = _run(["simulate", "--trace", str(bad)], capsys)
    assert code == 2 and "bad.jsonl:2" in err and len(err.strip().splitlines()) == 1


def test_trace_stats_and_gen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "gen.jsonl"
    code, _, _ = _run(["trace", "gen", "--out", str(out_path), "--num-requests", "20"], capsys)
    assert code == 0 and len(out_path.read_text().splitlines()) == 20
    code, out, _ = _run(["trace", "stats", str(out_path)], capsys)
    assert code == 0 and json.loads(out)["num_requests"] == 20


def _table(report: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header row starts with `header`."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x%"))


def _non_increasing(xs: list[float]) -> bool:
    return all(a >= b for a, b in zip(xs, xs[1:], strict=False))


def test_reproduce_figure9_reports_hit_rates_that_grow_with_capacity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Long sessions, few new ones: a working set of a few M tokens, so capacity matters.
    trace = tmp_path / "sessions.jsonl"
    generate_trace(TraceGenConfig(num_requests=1500, seed=3, max_turns=30, new_session_prob=0.15,
                                  mean_followup_len=300, mean_first_message_len=20000)).write(trace)
    out_dir = tmp_path / "rep"
    code, out, _ = _run(["reproduce", "figure9", "--trace", str(trace), "--out", str(out_dir)],
                        capsys)
    assert code == 0
    report = (out_dir / "figure9_sessions.md").read_text()
    rows = _table(report, "capacity (tokens)")
    assert [r[0] for r in rows] == ["1M", "2M", "3M", "5M", "10M", "20M", "50M", "100M",
                                    "unlimited"]
    rates = [_num(r[1]) for r in rows]
    assert rates == sorted(rates) and rates[0] < rates[2] < rates[-1]  # LRU: a stack algorithm
    best = rates[-1]
    assert [_num(r[2]) for r in rows] == [round(x / best, 2) for x in rates]
    share3 = rates[2] / best
    assert f"3M tokens reach {share3:.0%} of the maximum" in report
    assert ("(under half)" if share3 < 0.5 else "(NOT under half)") in report
    assert "Paper:" in report
    assert (out_dir / "figure9_sessions.png").read_bytes()[:4] == b"\x89PNG"


def _figure5(report: str) -> None:
    rows = {r[0]: _num(r[1]) for r in _table(report, "policy")}
    order = [rows[p] for p in ("random", "load_balance", "local_cache", "global_cache")]
    assert _non_increasing(order), rows  # the paper's order of mean TTFT holds on this trace
    assert "the order random > load_balance > local_cache > global_cache holds." in report
    load = _table(report, "speed")
    assert [r[0] for r in load] == ["1", "1.25", "1.5"]
    first = load[0]
    assert [_num(c) for c in first[1:5]] == [float(f"{x:.3g}") for x in order]
    assert _num(first[5]) == pytest.approx(order[3] / order[2], abs=2e-3)


def _figure10(report: str) -> None:
    rows = _table(report, "local cache per prefill node")
    assert [(r[0], r[1]) for r in rows] == [("1M", "local_cache"), ("1M", "global_cache"),
                                           ("3M", "local_cache"), ("3M", "global_cache")]
    for local, glob in (rows[0:2], rows[2:4]):
        assert _num(glob[2]) >= _num(local[2])  # a global cache sees every local hit
        assert _num(glob[3]) <= _num(local[3])  # so it computes no more prefill
        assert _num(glob[4]) >= 1.0 and _num(glob[5]) <= 1.0


def _figure13(report: str) -> None:
    rows = _table(report, "NIC Gbps")
    assert [r[0] for r in rows] == ["24", "50", "100", "200", "400", "800"]
    assert _non_increasing([_num(r[1]) for r in rows[1:]])  # global TTFT falls with bandwidth
    assert _non_increasing([_num(r[4]) for r in rows])  # and so does the KV hand-off wait
    assert _num(rows[-1][1]) < _num(rows[-1][2])  # at 800 Gbps fetching beats recomputing


def _figure15(report: str) -> None:
    rows = _table(report, "P:D")
    assert [r[0] for r in rows] == ["5:11", "6:10", "7:9", "8:8", "9:7", "10:6", "11:5"]
    assert _non_increasing([_num(r[2]) for r in rows])  # more prefill nodes: lower TTFT
    assert _non_increasing([-_num(r[4]) for r in rows])  # fewer decode nodes: higher TBT
    caps = [_num(r[1]) for r in rows]
    best = rows[caps.index(max(caps))][0]
    assert f"Ours: the best split is {best} by the share" in report


def _capacity(report: str) -> None:
    rows = {r[0]: [_num(c) for c in r[1:4]] for r in _table(report, "system")}
    assert list(rows) == ["mooncake", "vllm", "vllm_prefix_caching", "vllm_chunked_prefill"]
    for system, caps in rows.items():
        assert caps == sorted(caps), system  # a looser TBT threshold admits no fewer requests
    for i in range(3):
        assert rows["mooncake"][i] >= max(caps[i] for caps in rows.values())


ORDERINGS = {"figure5": _figure5, "figure10": _figure10, "figure13": _figure13,
             "figure15": _figure15, "capacity": _capacity}


def test_reproduce_unknown_experiment_exits_2(small_trace: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["reproduce", "figure99", "--trace", str(small_trace), "--out",
                         str(tmp_path)], capsys)
    assert code == 2 and "figure99" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("experiment", sorted(ORDERINGS))
def test_every_experiment_reports_its_orderings(experiment: str, small_trace: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "rep"
    code, out, _ = _run(["reproduce", experiment, "--trace", str(small_trace), "--out",
                         str(out_dir), "--max-requests", "25"], capsys)
    assert code == 0
    report = (out_dir / f"{experiment}_small.md").read_text()
    assert report.startswith("# ") and "paper" in report.lower() and "--max-requests 25" in report
    ORDERINGS[experiment](report)
    assert (out_dir / f"{experiment}_small.png").read_bytes()[:4] == b"\x89PNG"
