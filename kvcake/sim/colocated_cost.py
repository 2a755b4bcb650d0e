"""`ColocatedTerms`: a live profile's step terms of the colocated workers (live.colocated).

Two colocated workers on one host run mixed steps (their decode rows and a prefill chunk in one
forward) and contend for its cores. Measured from a live step trace of both workers
(`benchmarks/colocated_terms.py`, on the isolated 1-thread fits):

    "colocated": {"decode": 1.06, "decode_other_busy": 1.24,   # decode part of a step
                  "chunk": 1.15, "chunk_other_busy": 1.40,     # a chunk's share of its prefill
                  "step_overhead_s": 0.0005}                   # per step, outside the engine

A colocated step is priced as the simulator's sum of parts (kvcake/sim/decode.py): the decode
step of its rows times `decode` plus each chunk's share by tokens of its prompt's prefill fit
times `chunk`, plus `step_overhead_s`; the `*_other_busy` factors while another worker of the
host steps (the instance's runs follow the others', kvcake/sim/host.py). The factors replace the
live profile's `contention` for colocated runs (those are the disaggregated workers').

Pure: no torch, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcake.sim.decode import StepCosts

_FACTORS = ("decode", "decode_other_busy", "chunk", "chunk_other_busy")


@dataclass(frozen=True)
class ColocatedTerms:
    decode: float = 1.0
    decode_other_busy: float = 1.0
    chunk: float = 1.0
    chunk_other_busy: float = 1.0
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in _FACTORS:
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
        if not isinstance(data, dict) or set(data) - {*_FACTORS, "step_overhead_s"}:
            raise ValueError("live.colocated: expected {\"decode\", \"decode_other_busy\", "
                             "\"chunk\", \"chunk_other_busy\": factors, \"step_overhead_s\": "
                             f"seconds}} (all optional), got {data!r}")
        return cls(**{k: float(v) for k, v in data.items()})

    def step_costs(self, cost: Any) -> StepCosts:
        """A colocated instance's step costs on `cost` (a `LiveCost`: its isolated fits)."""
        overhead = self.step_overhead_s

        def decode(factor: float) -> Callable[[int, int], float]:
            def step_s(batch: int, context: int) -> float:
                if batch == 0:
                    return 0.0
                return cost.decode.decode_step_time_s(batch, context) * factor + overhead
            return step_s

        def chunk(factor: float) -> Callable[[int, int, int, int], float]:
            def chunk_s(input_len: int, prefix_len: int, num_tokens: int, _: int) -> float:
                new = input_len - prefix_len
                if new <= 0 or num_tokens <= 0:
                    return 0.0
                return max(0.0, cost.prefill.predict(input_len, prefix_len)) * factor \
                    * num_tokens / new
            return chunk_s

        return StepCosts(decode(self.decode), cost.prefill_time_s, chunk(self.chunk), overhead,
                         decode(self.decode_other_busy), chunk(self.chunk_other_busy))
