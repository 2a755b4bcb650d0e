"""Mooncake trace reader: validation of every kind of malformed line, statistics, scaling, sampling."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvcake.sim.trace import TraceFormatError, load_trace, parse_trace

GOLDEN = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 500, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 600, "output_length": 30, "hash_ids": [0, 3]},
    {"timestamp": 2000, "input_length": 512, "output_length": 40, "hash_ids": [4]},
]


def write(tmp_path: Path, rows: Sequence[object], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_golden_trace_loads_exactly(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, GOLDEN))
    assert len(trace) == 4 and trace.block_size == 512
    first = trace.requests[1]
    assert (first.index, first.timestamp_ms, first.arrival_s) == (1, 500.0, 0.5)
    assert (first.input_len, first.output_len, first.hash_ids) == (1500, 20, (0, 1, 2))


def test_golden_statistics(tmp_path: Path) -> None:
    stats = load_trace(write(tmp_path, GOLDEN)).stats()
    assert stats.num_requests == 4
    assert stats.mean_input_len == 3612 / 4 and stats.mean_output_len == 25.0
    assert stats.max_input_len == 1500
    # Reusable tokens: request 1 has seen blocks 0 and 1 (full: 512 + 512); request 2 block 0 (512).
    assert stats.reusable_share == pytest.approx((1024 + 512) / 3612)
    assert stats.duration_s == 2.0 and stats.arrival_rate_per_s == 2.0
    assert stats.to_dict()["num_requests"] == 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"timestamp": 0, "input_length": 10, "hash_ids": [0]}, "missing field"),
        ({"timestamp": "0", "input_length": 10, "output_length": 1, "hash_ids": [0]}, "timestamp must be"),
        ({"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [0]}, "input_length must be an integer"),
        ({"timestamp": 0, "input_length": True, "output_length": 1, "hash_ids": [0]}, "input_length must be an integer"),
        ({"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}, "input_length must be >= 1"),
        ({"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [0]}, "output_length must be >= 1"),
        ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}, "timestamp must be"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "0"}, "hash_ids must be a list"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}, "hash_ids must be a list"),
        ({"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}, r"ceil\(1025/512\) = 3"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]}, "has 2 ids"),
        ({"timestamp": 100, "input_length": 10, "output_length": 1, "hash_ids": [7]}, "goes back in time"),
    ],
)
def test_each_malformed_line_names_file_and_line(tmp_path: Path, line: object, message: str) -> None:
    rows: list[object] = [GOLDEN[0], GOLDEN[1], "", line, GOLDEN[3]]
    path = write(tmp_path, rows)
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:4: ")  # blank line 3 still counts
    assert isinstance(info.value, ValueError)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(write(tmp_path, ["", ""]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace(tmp_path / "absent.jsonl")


def test_block_size_is_a_parameter() -> None:
    trace = parse_trace([json.dumps({"timestamp": 0, "input_length": 40, "output_length": 1,
                                     "hash_ids": [0, 1, 2]})], "mem", block_size=16)
    assert trace.requests[0].hash_ids == (0, 1, 2)
    with pytest.raises(TraceFormatError, match="mem:1: .*ceil\\(40/512\\)"):
        parse_trace([json.dumps({"timestamp": 0, "input_length": 40, "output_length": 1,
                                 "hash_ids": [0, 1, 2]})], "mem")


def test_speed_divides_arrival_times(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, GOLDEN))
    fast = trace.scaled(2.0)
    assert [r.timestamp_ms for r in fast.requests] == [0.0, 250.0, 500.0, 1000.0]
    assert fast.stats().arrival_rate_per_s == 4.0
    assert trace.requests[1].timestamp_ms == 500.0  # the original is untouched
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="speed"):
            trace.scaled(bad)


def test_sampling_first_n_and_seeded_fraction(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, GOLDEN))
    assert [r.hash_ids for r in trace.sampled(first=2).requests] == [(0, 1), (0, 1, 2)]
    a = trace.sampled(fraction=0.5, seed=3)
    assert a == trace.sampled(fraction=0.5, seed=3) and len(a) == 2
    assert [r.index for r in a.requests] == [0, 1]
    stamps = [r.timestamp_ms for r in a.requests]
    assert stamps == sorted(stamps)
    with pytest.raises(ValueError, match="exactly one"):
        trace.sampled()
    with pytest.raises(ValueError, match="fraction"):
        trace.sampled(fraction=1.5)


def test_write_round_trips(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, GOLDEN))
    out = tmp_path / "out.jsonl"
    trace.write(out)
    assert out.read_text() == (tmp_path / "t.jsonl").read_text()
    half = trace.scaled(3.0)
    half.write(out)
    assert load_trace(out).requests[1].timestamp_ms == pytest.approx(500 / 3)


def test_published_traces_match_table_2(shared_traces: Path) -> None:
    conv = load_trace(shared_traces / "conversation_trace.jsonl").stats()
    assert conv.num_requests == 12031
    assert round(conv.mean_input_len) == 12035 and round(conv.mean_output_len) == 343
    assert 0.35 < conv.reusable_share < 0.40  # paper: ~40%
    syn = load_trace(shared_traces / "synthetic_trace.jsonl").stats()
    assert round(syn.mean_input_len) == 15325 and round(syn.mean_output_len) == 149
