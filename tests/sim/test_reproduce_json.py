"""`kvcake reproduce EXPERIMENT --json`: one JSON object of the experiment's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcake.cli import main
from kvcake.sim.tracegen import TraceGenConfig, generate_trace


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    generate_trace(TraceGenConfig(num_requests=60, rate_per_s=4.0, seed=5)).write(path)
    return path


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    data = json.loads(out)
    assert isinstance(data, dict)
    return data


def test_capacity_json_has_exactly_the_capacities_and_gains(
        trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(["reproduce", "capacity", "--trace", str(trace), "--out", str(tmp_path / "r"),
                  "--max-requests", "12", "--json"], capsys)
    assert set(data) == {"tbt_slo_ms", "systems", "gain_vs_best_baseline"}
    assert data["tbt_slo_ms"] == [100, 200, 300]
    systems = data["systems"]
    assert isinstance(systems, dict)
    assert sorted(systems) == ["mooncake", "vllm", "vllm_chunked_prefill", "vllm_prefix_caching"]
    for caps in systems.values():
        assert len(caps) == 3 and all(c >= 0 for c in caps)
    for i, gain in enumerate(data["gain_vs_best_baseline"]):  # type: ignore[arg-type]
        best = max(systems[b][i] for b in systems if b != "mooncake")
        assert gain == pytest.approx(systems["mooncake"][i] / best - 1)
    report = (tmp_path / "r" / "capacity_small.md").read_text()
    assert "| capacity (highest speed) of |" in report


@pytest.mark.parametrize("experiment", ["figure5", "figure9", "figure10"])
def test_every_experiment_prints_its_numbers_as_json(
        experiment: str, trace: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(["reproduce", experiment, "--trace", str(trace), "--out", str(tmp_path / "r"),
                  "--max-requests", "25", "--json"], capsys)
    assert data and all(isinstance(k, str) for k in data)


def test_overload_json_has_rejections_and_wasted_prefill_per_policy(
        trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(["reproduce", "overload", "--trace", str(trace), "--out", str(tmp_path / "r"),
                  "--max-requests", "40", "--speed", "8", "--json"], capsys)
    policies = data["policies"]
    assert isinstance(policies, dict)
    assert sorted(policies) == ["decode_after_prefill", "early", "prediction"]
    for numbers in policies.values():
        assert set(numbers) == {"rejected", "wasted_prefill_s", "decode_preemptions"}
        assert isinstance(numbers["rejected"], int) and numbers["wasted_prefill_s"] >= 0.0
        assert isinstance(numbers["decode_preemptions"], int)
    checked = data["with_check_after_prefill"]
    assert isinstance(checked, dict)
    assert sorted(checked) == ["early+check_after_prefill", "prediction+check_after_prefill"]
    report = (tmp_path / "r" / "overload_small_speed8.md").read_text()
    assert ("| policy | rejected | at arrival (TTFT) | at arrival (decode load) | after prefill |"
            in report)
    assert "x the prefill pool's capacity" in report
    assert "| corr(prefill queue, decode KV) |" in report
    assert (tmp_path / "r" / "overload_small_speed8.png").read_bytes()[:4] == b"\x89PNG"



def test_overload_with_reselection_at_hand_off_names_the_mode_in_file_command_and_text() -> None:
    from kvcake.sim.config import SimConfig
    from kvcake.sim.overload_report import setting_lines
    from kvcake.sim.pool_loads import PoolDemand
    from kvcake.sim.reproduce import Context, _command
    from kvcake.sim.trace import Trace

    demand = PoolDemand(0.2, 0.3, 10.0)
    for reselect in (False, True):
        base = SimConfig(speed=2.0, decode_reselect_at_handoff=reselect)
        command = _command("overload", Path("t.jsonl"), Path("o"), base)
        stem = Context(Trace((), "t"), Path("b/t.jsonl"), base, Path("o"), command, None).stem
        text = " ".join(setting_lines(base, 300, 30.0, demand))
        assert stem == ("t_speed2_reselect" if reselect else "t_speed2")
        assert command.endswith("--speed 2 --decode-reselect-at-handoff" if reselect
                                else "--speed 2")
        assert ("re-selection at hand-off" in text) == reselect
        assert ("a request that finds it full waits there for memory" in text) != reselect
