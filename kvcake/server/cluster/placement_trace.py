"""`PlacementTrace`: the live Conductor's decision for every request as JSON lines, so a run's
placements can be read beside the simulator's (`kvcake simulate --records`: each request's
`prefill_instance`, `decode_instance`, `predicted_ttft_s`) and beside its latencies
(diagnostics; off unless `$KVCAKE_PLACEMENT_TRACE` names a directory).

One line per request the disaggregated or colocated frontend asked the Conductor about:

    {"t": 12.5, "request_id": "cmpl-..", "prompt_tokens": 2709,
     "prefill_id": "colocated-0", "decode_id": "colocated-0", "prefill_group": [],
     "prefix_len": 122, "fetched_tokens": 0, "predicted_ttft_s": 0.45, "predicted_tbt_s": 0.01,
     "prefill_candidates": [{"instance_id": "colocated-0", "local_len": 122, "prefix_len": 122,
                             "transfer_s": 0.0, "queue_s": 0.0, "prefill_s": 0.45}, ...]}

or, for a request it turned away (HTTP 429), `"rejected"` (the reason's kind: `ttft_slo`,
`tbt_slo`, ...), `"reason"` (its text, with the predictions) and `"retry_after_s"` in place of
the placement. `t` is the frontend's clock (seconds on the monotonic clock, comparable with
`$KVCAKE_STEP_TRACE`'s lines on the same host); `prefill_candidates` are every prefill instance
(or CPP group) as Algorithm 1 priced it: its TTFT estimate is transfer_s + queue_s + prefill_s.
"""

from __future__ import annotations

import json
import os
from typing import Any, TextIO

from kvcake.conductor import Placement, ScheduleRequest
from kvcake.server.frontend.backend import Rejected
from kvcake.trace_dir import open_trace

__all__ = ["ENV", "PlacementTrace"]

ENV = "KVCAKE_PLACEMENT_TRACE"


class PlacementTrace:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    @classmethod
    def from_env(cls) -> PlacementTrace | None:
        """A trace into `$KVCAKE_PLACEMENT_TRACE/placements-<pid>.jsonl`, or None when unset."""
        out = open_trace(ENV, f"placements-{os.getpid()}.jsonl")
        return None if out is None else cls(out)

    def placed(self, now_s: float, request: ScheduleRequest, placement: Placement) -> None:
        fetch = placement.fetch
        self._write({
            **_head(now_s, request),
            "prefill_id": placement.prefill_id, "decode_id": placement.decode_id,
            "prefill_group": list(placement.prefill_group),
            "prefix_len": placement.prefix_len,
            "fetched_tokens": 0 if fetch is None else fetch.num_tokens,
            "predicted_ttft_s": placement.predicted_ttft_s,
            "predicted_tbt_s": placement.predicted_tbt_s,
            "prefill_candidates": [c._asdict() for c in placement.prefill_candidates]})

    def rejected(self, now_s: float, request: ScheduleRequest, rejection: Rejected) -> None:
        self._write({**_head(now_s, request), "rejected": rejection.kind,
                     "reason": rejection.reason, "retry_after_s": rejection.retry_after_s})

    def close(self) -> None:
        self._out.close()

    def _write(self, line: dict[str, Any]) -> None:
        self._out.write(json.dumps(line) + "\n")


def _head(now_s: float, request: ScheduleRequest) -> dict[str, Any]:
    return {"t": now_s, "request_id": request.request_id, "prompt_tokens": request.prompt_len}
