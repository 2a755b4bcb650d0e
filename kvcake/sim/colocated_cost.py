"""`ColocatedTerms`: a live profile's step terms of the colocated workers (live.colocated).

Two colocated workers on one host run mixed steps (their decode rows and a prefill chunk in one
forward) and contend for its cores. Measured from a live step trace of both workers
(`benchmarks/colocated_terms.py`, on the isolated 1-thread fits):

    "colocated": {"decode": 1.13, "decode_other_busy": 1.33,   # a decode-only step
                  "chunk": 1.33, "chunk_other_busy": 1.52,     # a chunk-only step's chunk
                  "chunk_mixed": 1.01,                         # a chunk beside decode rows
                  "chunk_mixed_other_busy": 1.21,
                  "step_overhead_s": 0.0006,                   # per step, outside the engine
                  "by_rows": {"decode_other_busy": [1.29, 1.40, 1.33, 1.26],   # optional
                              "chunk_mixed_other_busy": [1.22, 1.20, null, null]}}

A colocated step is priced as the simulator's sum of parts (kvcake/sim/decode.py): the decode
step of its rows times `decode` plus each chunk's share by tokens of its prompt's prefill fit
times a chunk factor, plus `step_overhead_s`; the `*_other_busy` factors while another worker
of the host steps (the instance's runs follow the others', kvcake/sim/host.py). The chunk factor
is `chunk_mixed` in a mixed step (the forward carries decode rows: `forward_tokens` above the
chunk's tokens) and `chunk` in a chunk-only step. The two differ because a forward's fixed cost
(weights read, per-layer work) is in the decode fit, which a mixed step pays once through its
decode part: a chunk-only step pays it through its chunk factor, a mixed step does not pay it
twice (the quiet 0.394 req/s colocated trace of 2026-12-02: a mixed step's wall is 1.05 / 1.25x
its isolated parts' sum, other worker idle / stepping, against 1.13 / 1.33x of its decode part
and 1.33 / 1.52x of a chunk-only step's chunk). Without `chunk_mixed*` (older profiles) a mixed
step's chunk takes `chunk`. The factors replace the live profile's `contention` for colocated
runs (those are the disaggregated workers').

`by_rows` (optional): the decode and mixed-chunk factors per decode-row bucket of the step
(entry i: i + 1 rows, the last entry: that many rows or more; `benchmarks/colocated_terms.py
--by-rows` measures 1, 2, 3, 4+). The other worker's effect depends on the batch (the quiet 0.394
req/s trace: a decode step with the other worker stepping is 1.29x its price at one row, 1.40x
at two, 1.33x at three, 1.26x at four or more), and one pooled factor per class misprices the
batches a run at another rate has. A `null` entry (a bucket the trace had too few steps of), a
missing key or a row count outside the table takes the pooled factor above; a profile without
`by_rows` prices exactly as before. A chunk-only step has no rows and keeps `chunk*`.

Pure: no torch, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcake.sim.decode import StepCosts

_FACTORS = ("decode", "decode_other_busy", "chunk", "chunk_other_busy")
_MIXED = ("chunk_mixed", "chunk_mixed_other_busy")
_BY_ROWS = ("decode", "decode_other_busy", "chunk_mixed", "chunk_mixed_other_busy")
MAX_ROW_BUCKETS = 64


@dataclass(frozen=True)
class RowFactors:
    """`live.colocated.by_rows`: factors per decode-row bucket (index i: i + 1 rows, the last:
    that many or more); None entries and empty tables mean the pooled factor."""

    decode: tuple[float | None, ...] = ()
    decode_other_busy: tuple[float | None, ...] = ()
    chunk_mixed: tuple[float | None, ...] = ()
    chunk_mixed_other_busy: tuple[float | None, ...] = ()

    def __post_init__(self) -> None:
        for name in _BY_ROWS:
            table = getattr(self, name)
            if not isinstance(table, tuple) or len(table) > MAX_ROW_BUCKETS:
                raise ValueError(f"live.colocated.by_rows.{name} must be a list of at most "
                                 f"{MAX_ROW_BUCKETS} factors (entry i: i + 1 decode rows, the "
                                 f"last: that many or more), got {table!r}")
            for i, value in enumerate(table):
                if value is not None and not (isinstance(value, (int, float))
                                              and not isinstance(value, bool)
                                              and 0 < value < math.inf):
                    raise ValueError(f"live.colocated.by_rows.{name}[{i}] must be a positive "
                                     f"finite factor or null (the pooled factor), got {value!r}")

    @classmethod
    def from_dict(cls, data: Any) -> RowFactors:
        if not isinstance(data, dict) or set(data) - set(_BY_ROWS) or not all(
                isinstance(v, list) for v in data.values()):
            raise ValueError("live.colocated.by_rows: expected {\"decode\", "
                             "\"decode_other_busy\", \"chunk_mixed\", "
                             "\"chunk_mixed_other_busy\": [factor or null per decode-row "
                             f"bucket]}} (all optional), got {data!r}")
        return cls(**{k: tuple(v) for k, v in data.items()})

    def factor(self, name: str, rows: int, pooled: float) -> float:
        """The factor `name` of a step with `rows` decode rows (`pooled` where the table has
        none)."""
        table: tuple[float | None, ...] = getattr(self, name)
        if not table or rows < 1:
            return pooled
        value = table[min(rows, len(table)) - 1]
        return pooled if value is None else float(value)


@dataclass(frozen=True)
class ColocatedTerms:
    decode: float = 1.0
    decode_other_busy: float = 1.0
    chunk: float = 1.0
    chunk_other_busy: float = 1.0
    step_overhead_s: float = 0.0
    # a chunk's factor in a mixed step (None, both: `chunk` / `chunk_other_busy`)
    chunk_mixed: float | None = None
    chunk_mixed_other_busy: float | None = None
    by_rows: RowFactors | None = None  # per decode-row bucket (None: the pooled factors)

    def __post_init__(self) -> None:
        given = [getattr(self, name) for name in _MIXED if getattr(self, name) is not None]
        if len(given) == 1:
            raise ValueError("live.colocated: give both chunk_mixed and chunk_mixed_other_busy "
                             "(a chunk's factor in a mixed step, other worker idle / stepping) "
                             "or neither")
        for name in _FACTORS + (_MIXED if given else ()):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"live.colocated.{name} must be a positive finite factor "
                                 f"(1.0: the isolated fit), got {value!r}")
        if not (isinstance(self.step_overhead_s, (int, float))
                and 0 <= self.step_overhead_s < math.inf):
            raise ValueError("live.colocated.step_overhead_s must be finite seconds >= 0, got "
                             f"{self.step_overhead_s!r}")

    @classmethod
    def from_dict(cls, data: Any) -> ColocatedTerms:
        if not isinstance(data, dict) or set(data) - {*_FACTORS, *_MIXED, "step_overhead_s",
                                                      "by_rows"}:
            raise ValueError("live.colocated: expected {\"decode\", \"decode_other_busy\", "
                             "\"chunk\", \"chunk_other_busy\", \"chunk_mixed\", "
                             "\"chunk_mixed_other_busy\": factors, \"step_overhead_s\": "
                             "seconds, \"by_rows\": {name: [factor per decode-row bucket]}} "
                             f"(all optional), got {data!r}")
        by_rows = None if data.get("by_rows") is None else RowFactors.from_dict(data["by_rows"])
        try:
            return cls(**{k: float(v) for k, v in data.items() if k != "by_rows"},
                       by_rows=by_rows)
        except (TypeError, ValueError) as err:
            if "live.colocated" in str(err):
                raise
            raise ValueError(f"live.colocated: every value must be a number, got {data!r}") \
                from err

    def step_costs(self, cost: Any) -> StepCosts:
        """A colocated instance's step costs on `cost` (a `LiveCost`: its isolated fits)."""
        overhead = self.step_overhead_s
        rows_table = self.by_rows or RowFactors()

        def decode(name: str, pooled: float) -> Callable[[int, int], float]:
            def step_s(batch: int, context: int) -> float:
                if batch == 0:
                    return 0.0
                return (cost.decode.decode_step_time_s(batch, context)
                        * rows_table.factor(name, batch, pooled) + overhead)
            return step_s

        def chunk(alone: float, name: str, mixed: float | None
                  ) -> Callable[[int, int, int, int], float]:
            beside_rows = alone if mixed is None else mixed

            def chunk_s(input_len: int, prefix_len: int, num_tokens: int,
                        forward_tokens: int) -> float:
                new = input_len - prefix_len
                if new <= 0 or num_tokens <= 0:
                    return 0.0
                rows = forward_tokens - num_tokens  # the decode rows in the same forward
                factor = rows_table.factor(name, rows, beside_rows) if rows > 0 else alone
                return max(0.0, cost.prefill.predict(input_len, prefix_len)) * factor \
                    * num_tokens / new
            return chunk_s

        return StepCosts(decode("decode", self.decode), cost.prefill_time_s,
                         chunk(self.chunk, "chunk_mixed", self.chunk_mixed), overhead,
                         decode("decode_other_busy", self.decode_other_busy),
                         chunk(self.chunk_other_busy, "chunk_mixed_other_busy",
                               self.chunk_mixed_other_busy))
