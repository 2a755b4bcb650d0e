"""A minimal Mooncake JSONL reader, used until `kvcake/sim/trace.py` lands (then removed).

Each line: {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRecord:
    timestamp: int  # ms since the start of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceRecord]:
    if not path.is_file():
        raise FileNotFoundError(f"--trace: no such file {path}")
    records: list[TraceRecord] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if max_requests is not None and len(records) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                records.append(TraceRecord(int(raw["timestamp"]), int(raw["input_length"]),
                                           int(raw["output_length"]),
                                           tuple(int(h) for h in raw["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record ({exc})") from None
    return records
