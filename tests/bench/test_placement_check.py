"""benchmarks/placement_check.py: the live Conductor's recorded decisions beside the simulated
ones for the same requests; the warm-up lines before them are skipped, a replay without
placements is left out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import placement_check  # noqa: E402

from kvcake.sim.config import SimConfig  # noqa: E402
from kvcake.sim.trace import Trace, TraceRequest  # noqa: E402

# two requests at once on two idle colocated instances: the simulator puts r0 on colocated-0
# and r1 on colocated-1 (tests/sim/test_cluster.py)
TRACE = Trace((TraceRequest(0, 0, 1024, 3, (1, 2)), TraceRequest(1, 0, 1024, 2, (3, 4))), "t")
CONFIG = SimConfig(num_prefill=1, num_decode=1, policy="colocated",
                   profile="llama3-70b@a800x8-roofline")


def placed(instance: str) -> dict[str, Any]:
    return {"t": 1.0, "request_id": "x", "prompt_tokens": 1024, "prefill_id": instance}


def test_a_decision_is_the_prefill_instance_or_the_rejections_kind() -> None:
    assert placement_check.decision(placed("colocated-1")) == "colocated-1"
    assert placement_check.decision({"t": 1.0, "rejected": "ttft_slo"}) == "rejected:ttft_slo"


def test_each_replay_counts_its_requests_decided_alike() -> None:
    warm_up = placed("colocated-0") | {"prompt_tokens": 16}
    live = {"runs": {"colocated": [
        {"env": {"placements": [warm_up, placed("colocated-0"), placed("colocated-1")]}},
        {"env": {"placements": [warm_up, placed("colocated-0"), placed("colocated-0")]}},
        {"env": {}},  # recorded before the placement trace: left out
    ]}}
    got = placement_check.agreement(live, TRACE, {"colocated": CONFIG}, None)
    assert got == {"colocated": {"same": [2, 1], "of": 2, "differ": [1]}}


def test_systems_without_placements_are_left_out() -> None:
    live = {"runs": {"colocated": [{"env": {"placements": [placed("colocated-0")]}}]}}
    assert placement_check.agreement(live, TRACE, {"colocated": CONFIG}, None) == {}
