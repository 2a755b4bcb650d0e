"""Mooncake request traces: reading, validation, statistics, time scaling and sub-sampling.

The format (the published traces, one JSON object per line):

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is the arrival in milliseconds from the start (non-decreasing); `hash_ids` has one id
per `block_size` (512) tokens of the prompt, the last block possibly partial, so
len(hash_ids) == ceil(input_length / block_size) (true of every line of both published traces).
Ids are chained: an id names its block and everything before it, so equal ids mean a shared prefix.

Every line is validated; the first malformed one raises `TraceFormatError` naming the file and the
line, and nothing is returned (no half-loaded trace).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEFAULT_BLOCK_SIZE = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(ValueError):
    """A malformed trace line: the message names the file and the 1-based line number."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. `index` is its position in the trace (0-based)."""

    index: int
    timestamp_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def to_json(self) -> str:
        ts: float | int = int(self.timestamp_ms) if float(self.timestamp_ms).is_integer() \
            else self.timestamp_ms
        return json.dumps({"timestamp": ts, "input_length": self.input_len,
                           "output_length": self.output_len, "hash_ids": list(self.hash_ids)})


@dataclass(frozen=True)
class TraceStats:
    """The paper's Table 2 figures for one trace.

    reusable_share: prompt tokens in blocks whose hash id appeared in an earlier request, over all
    prompt tokens: the best hit rate an unlimited cache could reach.
    arrival_rate_per_s: num_requests / duration_s (None when all arrive at once).
    """

    num_requests: int
    mean_input_len: float
    mean_output_len: float
    max_input_len: int
    reusable_share: float
    duration_s: float
    arrival_rate_per_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Trace:
    """A validated trace: requests in arrival order, where they came from, their block size."""

    requests: tuple[TraceRequest, ...]
    source: str
    block_size: int = DEFAULT_BLOCK_SIZE

    def __len__(self) -> int:
        return len(self.requests)

    def scaled(self, speed: float) -> Trace:
        """Arrivals divided by `speed` (2.0 replays twice as fast)."""
        if not (isinstance(speed, int | float) and math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
        requests = tuple(replace(r, timestamp_ms=r.timestamp_ms / speed) for r in self.requests)
        return replace(self, requests=requests, source=f"{self.source} (speed {speed:g})")

    def sampled(self, fraction: float | None = None, first: int | None = None,
                seed: int = 0) -> Trace:
        """A sub-trace: the first `first` requests, or a seeded random `fraction` of them (order
        kept, indices renumbered). Exactly one of the two must be given."""
        if (fraction is None) == (first is None):
            raise ValueError("sampled: give exactly one of fraction or first")
        if first is not None:
            if first < 1:
                raise ValueError(f"first must be >= 1, got {first}")
            chosen = list(self.requests[:first])
        else:
            assert fraction is not None
            if not 0 < fraction <= 1:
                raise ValueError(f"fraction must be in (0, 1], got {fraction}")
            count = max(1, round(fraction * len(self.requests)))
            picks = sorted(random.Random(seed).sample(range(len(self.requests)), count))
            chosen = [self.requests[i] for i in picks]
        requests = tuple(replace(r, index=i) for i, r in enumerate(chosen))
        what = f"first {first}" if first is not None else f"{fraction:g} sample, seed {seed}"
        return replace(self, requests=requests, source=f"{self.source} ({what})")

    def stats(self) -> TraceStats:
        return trace_stats(self)

    def write(self, path: str | Path) -> None:
        Path(path).write_text("".join(r.to_json() + "\n" for r in self.requests))


def load_trace(path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """Read and validate a JSONL trace. FileNotFoundError if absent, TraceFormatError if malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    with path.open(encoding="utf-8") as lines:
        return parse_trace(lines, str(path), block_size)


def parse_trace(lines: Iterable[str], source: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """Validate trace lines (blank lines are skipped); `source` names them in errors."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    requests: list[TraceRequest] = []
    last_ts = 0.0
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            req = _parse_line(line, len(requests), block_size)
            if req.timestamp_ms < last_ts:
                raise ValueError(f"timestamp {req.timestamp_ms:g} goes back in time (previous "
                                 f"line: {last_ts:g}); sort the trace by timestamp")
        except ValueError as exc:
            raise TraceFormatError(f"{source}:{line_no}: {exc}") from None
        last_ts = req.timestamp_ms
        requests.append(req)
    if not requests:
        raise TraceFormatError(f"{source}: the trace has no requests")
    return Trace(tuple(requests), source, block_size)


def _int_field(obj: dict[str, Any], name: str, minimum: int) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _parse_line(line: str, index: int, block_size: int) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}; each line needs {', '.join(_FIELDS)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a finite number >= 0 (milliseconds), got {ts!r}")
    input_len = _int_field(obj, "input_length", 1)
    output_len = _int_field(obj, "output_length", 1)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hash_ids):
        raise ValueError("hash_ids must be a list of integers >= 0")
    expected = -(-input_len // block_size)
    if len(hash_ids) != expected:
        raise ValueError(f"hash_ids has {len(hash_ids)} ids but input_length {input_len} needs "
                         f"ceil({input_len}/{block_size}) = {expected}")
    return TraceRequest(index, float(ts), input_len, output_len, tuple(hash_ids))


def trace_stats(trace: Trace) -> TraceStats:
    seen: set[int] = set()
    reusable = 0
    bs = trace.block_size
    for req in trace.requests:
        for i, block in enumerate(req.hash_ids):
            if block in seen:
                reusable += min(bs, req.input_len - i * bs)
        seen.update(req.hash_ids)
    reqs = trace.requests
    total_in = sum(r.input_len for r in reqs)
    duration_s = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0
    return TraceStats(
        num_requests=len(reqs),
        mean_input_len=total_in / len(reqs),
        mean_output_len=sum(r.output_len for r in reqs) / len(reqs),
        max_input_len=max(r.input_len for r in reqs),
        reusable_share=reusable / total_in,
        duration_s=duration_s,
        arrival_rate_per_s=len(reqs) / duration_s if duration_s > 0 else None,
    )
