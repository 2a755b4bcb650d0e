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


def test_reproduce_figure9_writes_report_and_png(small_trace: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "rep"
    code, out, _ = _run(["reproduce", "figure9", "--trace", str(small_trace), "--out",
                         str(out_dir)], capsys)
    assert code == 0
    report = (out_dir / "figure9_small.md").read_text()
    assert "| unlimited |" in report and "Paper:" in report
    assert (out_dir / "figure9_small.png").read_bytes()[:4] == b"\x89PNG"


def test_reproduce_unknown_experiment_exits_2(small_trace: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["reproduce", "figure99", "--trace", str(small_trace), "--out",
                         str(tmp_path)], capsys)
    assert code == 2 and "figure99" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("experiment", ["figure5", "figure10", "figure13", "figure15", "capacity"])
def test_every_experiment_writes_a_report(experiment: str, small_trace: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "rep"
    code, out, _ = _run(["reproduce", experiment, "--trace", str(small_trace), "--out",
                         str(out_dir), "--max-requests", "25"], capsys)
    assert code == 0
    report = (out_dir / f"{experiment}_small.md").read_text()
    assert report.startswith("# ") and "paper" in report.lower() and "--max-requests 25" in report
    assert (out_dir / f"{experiment}_small.png").read_bytes()[:4] == b"\x89PNG"
