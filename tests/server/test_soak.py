"""The chaos soak, short (`benchmarks/soak.py --short`: about a minute, one fault of each
kind against `kvcake serve --prefill 2 --decode 2`): nothing lost, nothing wrong, no 5xx, and
the server serves after. Capacity-back times are reported, not asserted (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"

FAULTS = ["kill_decode", "kill_prefill", "stop_worker", "kill_store_node", "transport",
          "client_disconnect"]

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not TRACE.is_file(), reason=f"needs the shared trace {TRACE} (../shared)")
def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--out",
                    str(out), "--trace", str(TRACE)], check=True, timeout=280,
                   stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert [f["kind"] for f in report["faults"]] == list(FAULTS)
    assert report["sent"] > 0 and report["completed"] > 0
    assert sum(report[k] for k in ("completed", "rejected", "clean_error", "client_aborted",
                                   "5xx", "lost")) == report["sent"]
    assert (report["lost"], report["wrong"], report["5xx"]) == (0, 0, 0), \
        report["lost_examples"]
    assert report["server_alive_after"]
