"""Per-request state of a simulated run, its JSONL record and the run's summary."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcake.sim.metrics import GapLog, stats


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as the simulator replays it (a trace line after `--speed`)."""

    arrival_s: float
    input_len: int
    output_len: int
    block_keys: tuple[int, ...]


@dataclass(slots=True)
class RequestState:
    """What happened to one request. Times are simulated seconds; None: did not happen."""

    index: int
    request_id: str
    arrival: Arrival
    prefill_instance: str | None = None
    decode_instance: str | None = None
    preselected_decode: str | None = None  # the decode instance chosen at arrival
    prefix_len: int = 0  # prompt tokens whose KV was reused
    fetched_len: int = 0  # of those, tokens fetched from another holder
    predicted_ttft_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: str | None = None  # the reason, for a rejected request
    gaps: GapLog = field(default_factory=GapLog)
    fetch_s: float = 0.0  # seconds from placement until the planned fetch landed
    kv_wait_s: float = 0.0  # seconds the KV hand-off outlasted the prefill
    pending_fetches: int = 0
    prefill_done: bool = False
    kv_arrived: bool = False
    prefill_start_s: float | None = None
    prefill_group: tuple[int, ...] = ()  # CPP: the prefill nodes of its pipeline
    pending_kv: int = 0  # KV hand-off flows still in flight (one per sending prefill node)
    kv_epoch: int = 0  # bumped when the KV is sent to another decode node (old flows ignored)
    prefill_s: float = 0.0  # prefill compute seconds spent on it (wasted if rejected after)
    decode_join_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival.arrival_s

    def record(self) -> dict[str, Any]:
        """The JSONL record (one line per request)."""
        a = self.arrival
        tbt = self.gaps.tbt_s()
        return {
            "request_id": self.request_id,
            "arrival_s": round(a.arrival_s, 6),
            "input_tokens": a.input_len,
            "output_tokens": a.output_len,
            "prefill_instance": self.prefill_instance,
            "decode_instance": self.decode_instance,
            "prefix_reused_tokens": self.prefix_len,
            "fetched_tokens": self.fetched_len,
            "fetch_s": round(self.fetch_s, 6),
            "kv_wait_s": round(self.kv_wait_s, 6),
            "predicted_ttft_s": _round(self.predicted_ttft_s),
            "ttft_s": _round(self.ttft_s),
            "tbt_s": _round(tbt),
            "finish_s": _round(self.finish_s),
            "rejected": self.rejected is not None,
            "reject_reason": self.rejected,
            "prefill_s": round(self.prefill_s, 6),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def is_effective(state: RequestState, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """Completed within both SLOs (a request without token gaps meets any TBT SLO)."""
    if state.finish_s is None or state.ttft_s is None or state.ttft_s > ttft_slo_s:
        return False
    tbt = state.gaps.tbt_s()
    return tbt is None or tbt <= tbt_slo_s


def summarize(
    states: Sequence[RequestState], ttft_slo_s: float, tbt_slo_s: float, extra: dict[str, Any]
) -> dict[str, Any]:
    """The run's summary: counts, TTFT/TBT statistics, effective capacity, cache hit rate."""
    completed = [s for s in states if s.finish_s is not None]
    ttfts = [s.ttft_s for s in completed if s.ttft_s is not None]
    tbts = [t for t in (s.gaps.tbt_s() for s in completed) if t is not None]
    prompt = sum(s.arrival.input_len for s in completed)
    reused = sum(s.prefix_len for s in completed)
    reasons: dict[str, int] = {}
    for s in states:
        if s.rejected is not None:
            reasons[s.rejected] = reasons.get(s.rejected, 0) + 1
    effective = sum(1 for s in states if is_effective(s, ttft_slo_s, tbt_slo_s))
    summary: dict[str, Any] = {
        "requests": len(states),
        "completed": len(completed),
        "rejected": sum(reasons.values()),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "ttft_s": stats(ttfts).to_dict(),
        "tbt_s": stats(tbts).to_dict(),
        "effective_requests": effective,
        "effective_request_capacity": effective / len(states) if states else 0.0,
        "cache_hit_rate": reused / prompt if prompt else 0.0,
        "fetched_tokens": sum(s.fetched_len for s in completed),
        "wasted_prefill_s": sum(s.prefill_s for s in states if s.rejected is not None),
    }
    summary.update(extra)
    return summary


def tbt_values(states: Iterable[RequestState]) -> list[float]:
    return [t for t in (s.gaps.tbt_s() for s in states if s.finish_s is not None) if t is not None]


def write_records(path: Path, states: Iterable[RequestState]) -> None:
    with path.open("w") as out:
        for s in states:
            out.write(json.dumps(s.record(), sort_keys=True) + "\n")
