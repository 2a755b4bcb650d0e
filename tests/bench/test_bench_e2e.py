"""`kvcake bench` end to end: a 10-request synthetic trace against a real local kvcake server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvcake.bench.prompts import PromptBuilder
from kvcake.cli import main
from kvcake.engine.config import EngineConfig
from kvcake.server.frontend.api import ApiServer, create_app
from kvcake.server.frontend.local_backend import LocalBackend, LocalBackendConfig


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    config = LocalBackendConfig(engine=EngineConfig(kv_cache_bytes=16 * 2**20))
    with LocalBackend.from_config(config) as backend, ApiServer(create_app(backend)) as api:
        yield api.url


def write_trace(path: Path, num_requests: int = 10) -> Path:
    lines = [json.dumps({"timestamp": 100 * i, "input_length": 1024 + 512 * (i % 2),
                         "output_length": 64, "hash_ids": [0, 1 + i, 100 + i][:2 + i % 2]})
             for i in range(num_requests)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_replays_a_trace_and_reports(server_url: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.jsonl")
    status = main(["bench", "--trace", str(trace), "--url", server_url, "--speed", "4",
                   "--scale-tokens", "0.0625", "--out", str(tmp_path / "out"),
                   "--tbt-slo-ms", "5000"])
    assert status == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny"
    assert (report["num_prompts"], report["completed"], report["rejected"], report["errors"]) == (
        10, 10, 0, 0)
    # 1024 or 1536 tokens scaled by 1/16; outputs of 64 scaled to exactly 4 (ignore_eos)
    assert report["total_input_tokens"] == 5 * 64 + 5 * 96
    assert report["total_output_tokens"] == 40
    for field in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                  "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_tbt_ms",
                  "p90_tbt_ms", "p99_tbt_ms", "goodput", "duration"):
        assert report[field] > 0, field
    assert report["effective_request_capacity"] == 1.0  # generous SLOs on an idle server
    assert report["duration"] >= 0.9 / 4  # the last request is sent 900 ms / speed 4 in
    # The server now caches the replayed prompts' blocks: the prompt the client built for
    # record 0 (hash ids [0, 1], 64 tokens) is found again, so the client's blocks are real.
    prompt = PromptBuilder(vocab_size=512, scale_tokens=0.0625).build([0, 1], 1024, 0)
    again = httpx.post(server_url + "/v1/completions",
                       json={"prompt": prompt, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["completed"] == 10
    assert saved["output_lens"] == [4] * 10
    assert saved["input_lens"] == [64, 96] * 5
    assert [len(gaps) for gaps in saved["itls"]] == [3] * 10  # one SSE chunk per token
    assert (tmp_path / "out" / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "out" / "tbt_cdf.png").stat().st_size > 0


def test_find_capacity_reports_probes(server_url: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", num_requests=4)
    status = main(["bench", "--trace", str(trace), "--url", server_url, "--speed", "8",
                   "--scale-tokens", "0.0625", "--find-capacity", "--max-capacity-probes", "2",
                   "--ttft-slo-s", "30", "--tbt-slo-ms", "5000"])
    assert status == 0
    capacity = json.loads(capsys.readouterr().out)["capacity"]
    assert [p["speed"] for p in capacity["probes"]] == [8.0, 16.0]  # both pass: it doubles
    assert capacity["best_speed"] == 16.0
    assert capacity["best_request_rate"] == pytest.approx(3 / (0.3 / 16))


def test_help_renders(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert ">= 90% of requests meet both SLOs" in " ".join(capsys.readouterr().out.split())


def test_bad_flags_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trace", str(tmp_path / "none.jsonl"), "--url", "http://x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    trace = write_trace(tmp_path / "t.jsonl", 1)
    assert main(["bench", "--trace", str(trace), "--url", "http://x", "--speed", "0"]) == 2
    assert "--speed must be > 0" in capsys.readouterr().err
    assert main(["bench", "--trace", str(trace), "--url", "http://127.0.0.1:1"]) == 2
    assert "--url: cannot read http://127.0.0.1:1/v1/models" in capsys.readouterr().err
