"""A colocated worker's step trace (`$KVCAKE_STEP_TRACE`): each step's decode rows and the
prompt chunks it computed beside them (`PrefillRole.step`), what benchmarks/colocated_terms.py
reads."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvcake.engine.step_trace import StepTrace
from kvcake.server.worker.prefill import PrefillRole


def _ticks(*values: float) -> Callable[[], float]:
    it = iter(values)
    return lambda: next(it)


@dataclass
class _Seq:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return max(self.num_prompt_tokens, self.num_computed_tokens + 1)


class _Engine:
    """Computes `plan` (request -> tokens) in one step, calling the layer hook at layer 0."""

    block_size = 16
    config = SimpleNamespace(max_num_batched_tokens=64)

    def __init__(self, seqs: list[_Seq], plan: dict[str, int]) -> None:
        self.batcher = SimpleNamespace(running=seqs)
        self.plan = plan

    def step(self, layer_hook: Callable[[int], None]) -> list[Any]:
        layer_hook(0)
        for seq in self.batcher.running:
            seq.num_computed_tokens += self.plan.get(seq.request_id, 0)
        return []


def test_a_mixed_step_traces_its_decode_rows_and_chunks() -> None:
    out = io.StringIO()
    role = PrefillRole.__new__(PrefillRole)
    role._trace = StepTrace(out, clock=_ticks(5.0, 5.03, 5.031), cpu=_ticks(1.0, 1.028))
    role._live, role._in_step, role._traced = {}, [], []
    # a decoding sequence (prompt 300, 310 computed), a prompt 128 tokens into 700, one not run
    seqs = [_Seq("d", 300, 310), _Seq("p", 700, 128), _Seq("idle", 500, 0)]
    role.engine = _Engine(seqs, {"d": 1, "p": 63})  # type: ignore[assignment]
    role.step()
    line = json.loads(out.getvalue())
    assert line == {"t0": 5.0, "t1": 5.03, "t2": 5.031, "cpu": pytest.approx(0.028),
                    "rows": [["d", 311]], "chunks": [["p", 128, 63, 700]]}


def test_no_trace_no_line() -> None:
    role = PrefillRole.__new__(PrefillRole)
    role._trace, role._live, role._in_step, role._traced = None, {}, [], []
    role.engine = _Engine([_Seq("d", 300, 310)], {"d": 1})  # type: ignore[assignment]
    role.step()
    assert role._traced == []
