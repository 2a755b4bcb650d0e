"""`StepTrace`: a decode worker's per-step timing as JSON lines, where the time between two
tokens of a request goes on the worker (diagnostics; off unless `$KVCAKE_STEP_TRACE` names a
directory).

One line per engine step: `{"t0", "t1", "t2", "cpu", "rows"}`, the step's start and end and the
end of sending its tokens (seconds on the monotonic clock, comparable with other processes' on
the same host), the engine thread's CPU seconds in the step, and the sequences it ran
(`[request_id, context tokens]`); a colocated worker's line also has `chunks`, the prompt chunks
the step computed beside its decode rows (`[request_id, first position, tokens, prompt tokens]`;
its `rows` then only the decoding sequences). The gap from one line's `t2` to the next's `t0` is the loop's
time outside the engine (inbox, orders, load reports). `benchmarks/decode_gaps.py` reads it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from kvcake.clock import SystemClock
from kvcake.trace_dir import open_trace

ENV = "KVCAKE_STEP_TRACE"


class StepTrace:
    def __init__(self, out: TextIO, clock: Callable[[], float] | None = None,
                 cpu: Callable[[], float] = time.thread_time) -> None:
        self._out = out
        self.now = clock or SystemClock().now_s
        self.cpu = cpu

    @classmethod
    def from_env(cls, worker_id: str) -> StepTrace | None:
        """A trace into `$KVCAKE_STEP_TRACE/steps-<worker_id>-<pid>.jsonl`, or None when unset."""
        out = open_trace(ENV, f"steps-{worker_id}-{os.getpid()}.jsonl")
        return None if out is None else cls(out)

    def record(self, t0: float, t1: float, t2: float, cpu_s: float,
               rows: Sequence[tuple[str, int]],
               chunks: Sequence[tuple[str, int, int, int]] | None = None) -> None:
        line: dict[str, object] = {"t0": t0, "t1": t1, "t2": t2, "cpu": cpu_s,
                                   "rows": [[rid, n] for rid, n in rows]}
        if chunks is not None:
            line["chunks"] = [list(c) for c in chunks]
        self._out.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._out.close()
