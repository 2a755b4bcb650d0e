"""`$KVCAKE_PLACEMENT_TRACE`: the disaggregated frontend writes the Conductor's decision for
every request as a JSON line (placement with its candidates, or the rejection); nothing without
it; a path that is not a directory is refused by name. Fake workers, a manual clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvcake.clock import ManualClock
from kvcake.conductor import ConductorConfig
from kvcake.server.cluster.backend import DisaggBackend, DisaggConfig
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.placement_trace import ENV, PlacementTrace
from kvcake.server.frontend.backend import GenerateRequest, Rejected
from kvcake.server.worker.messages import KvReserved, LoadReport, ReserveKv
from kvcake.types import RequestId
from tests.server.cluster.fakes import DECODE, NUM_BLOCKS, PREFILL, FakeWorker

PROMPT = tuple(range(1, 41))


def _serve(tmp_path: Path, conductor: ConductorConfig) -> list[dict[str, object]]:
    """Ask a 1P+1D backend (fake workers) for one request; the trace's lines."""
    p, d = FakeWorker("prefill-0", "prefill").start(), FakeWorker("decode-1", "decode").start()
    clock = ManualClock(start_s=7.0)
    config = DisaggConfig("tiny", (p.address, d.address), run_monitor=False, conductor=conductor,
                          monitor=MonitorConfig(worker_timeout_s=5.0, ping_interval_s=1.0))
    backend = DisaggBackend(config, PREFILL, DECODE, clock).start()

    async def ask() -> None:
        try:
            await backend.generate(GenerateRequest(RequestId("r"), PROMPT, 3))
        except Rejected:
            return
        assert isinstance(d.next(), ReserveKv)
        d.send(LoadReport(0, 1, NUM_BLOCKS // 4))
        d.send(KvReserved("r", {"name": "kv-pool-decode-1"}, NUM_BLOCKS, [1, 2, 3]))

    try:
        asyncio.run(ask())
    finally:
        backend.close()
        p.close()
        d.close()
    [path] = tmp_path.glob("placements-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_placement_is_written_with_every_candidate(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    [line] = _serve(tmp_path, ConductorConfig())
    candidates = line.pop("prefill_candidates")
    predicted = line.pop("predicted_ttft_s")
    assert line.pop("predicted_tbt_s") == pytest.approx(DECODE.decode_step_time_s(1, 40))
    assert line == {"t": 7.0, "request_id": "r", "prompt_tokens": 40, "prefill_id": "prefill-0",
                    "decode_id": "decode-1", "prefill_group": [], "prefix_len": 0,
                    "fetched_tokens": 0}
    assert isinstance(candidates, list) and len(candidates) == 1
    [c] = candidates
    assert (c["instance_id"], c["local_len"], c["prefix_len"], c["queue_s"]) == \
        ("prefill-0", 0, 0, 0.0)
    assert c["transfer_s"] + c["queue_s"] + c["prefill_s"] == pytest.approx(predicted)
    assert c["prefill_s"] == pytest.approx(PREFILL.predict(40, 0))


def test_a_rejection_is_written_with_its_reason(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    [line] = _serve(tmp_path, ConductorConfig(ttft_slo_s=1e-9))
    assert (line["t"], line["request_id"], line["prompt_tokens"], line["rejected"]) == \
        (7.0, "r", 40, "ttft_slo")
    assert "predicted TTFT" in str(line["reason"]) and float(str(line["retry_after_s"])) > 0
    assert "prefill_id" not in line


def test_no_trace_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert PlacementTrace.from_env() is None


def test_a_path_that_is_not_a_directory_is_refused_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=rf"^\${ENV}=.*missing.*: not a directory; create it "
                                         rf"or unset {ENV}"):
        PlacementTrace.from_env()
