"""Latency metrics of a benchmark run, as the field defines them.

- TTFT: request sent -> first token received.
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: every gap between consecutive token arrivals, pooled over requests (vLLM's definition).
- MOONCAKE TBT: per request, the mean of its slowest 10% of gaps (at least one gap); a request
  with no gaps has TBT 0.
- Effective request: completed, TTFT <= TTFT SLO and TBT <= TBT SLO. Effective request capacity is
  the share of *all* sent requests that are effective (a rejected or failed request is not).

`summarize` returns the `vllm bench serve` JSON field names (`completed`, `mean_ttft_ms`,
`p99_itl_ms`, ...) plus ours (`mean_tbt_ms`, `effective_request_capacity`, `rejected`, ...).
Percentiles use numpy's linear interpolation, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


class Outcome(StrEnum):
    OK = "ok"
    REJECTED = "rejected"  # HTTP 429
    ERROR = "error"  # any other failure


@dataclass(frozen=True)
class RequestResult:
    """What the client saw of one request. Times are seconds from the moment it was sent."""

    outcome: Outcome
    prompt_len: int
    output_len: int = 0
    ttft_s: float | None = None
    gaps_s: tuple[float, ...] = ()  # between consecutive token arrivals
    latency_s: float | None = None
    error: str = ""


def paper_tbt_s(gaps_s: Sequence[float]) -> float:
    """MOONCAKE's TBT of one request: the mean of its slowest 10% of gaps (at least one)."""
    if not gaps_s:
        return 0.0
    k = max(1, math.ceil(0.1 * len(gaps_s)))
    return float(np.mean(sorted(gaps_s, reverse=True)[:k]))


def tpot_s(result: RequestResult) -> float | None:
    if result.output_len < 2 or result.ttft_s is None or result.latency_s is None:
        return None
    return (result.latency_s - result.ttft_s) / (result.output_len - 1)


def is_effective(result: RequestResult, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    return (result.outcome is Outcome.OK and result.ttft_s is not None
            and result.ttft_s <= ttft_slo_s and paper_tbt_s(result.gaps_s) <= tbt_slo_s)


def effective_shares(results: Sequence[RequestResult], ttft_slo_s: float,
                     tbt_slos_s: Sequence[float]) -> list[float]:
    """The effective share of *all* sent requests (a rejected or failed one is a miss) at each
    of several TBT SLOs, under one TTFT SLO: what one replay gives a capacity search."""
    return [sum(is_effective(r, ttft_slo_s, slo) for r in results) / max(1, len(results))
            for slo in tbt_slos_s]


def per_request(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """Per-request arrays as `vllm bench serve` saves them (seconds), plus ours."""
    return {
        "outcomes": [r.outcome.value for r in results],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft_s for r in results],
        "itls": [list(r.gaps_s) for r in results],
        "tbts": [paper_tbt_s(r.gaps_s) if r.outcome is Outcome.OK else None for r in results],
        "errors_per_request": [r.error for r in results],
    }


def _distribution(name: str, values_s: Sequence[float]) -> dict[str, float]:
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values_ms.size == 0:
        values_ms = np.zeros(1)  # vLLM reports 0 for an empty distribution
    out = {
        f"mean_{name}_ms": float(values_ms.mean()),
        f"median_{name}_ms": float(np.median(values_ms)),
        f"std_{name}_ms": float(values_ms.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, ttft_slo_s: float,
              tbt_slo_s: float) -> dict[str, Any]:
    """The run's report (see the module docstring for the definitions)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in results if r.outcome is Outcome.OK]
    num_effective = sum(is_effective(r, ttft_slo_s, tbt_slo_s) for r in results)
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    report: dict[str, Any] = {
        "duration": duration_s,
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "rejected": sum(r.outcome is Outcome.REJECTED for r in results),
        "errors": sum(r.outcome is Outcome.ERROR for r in results),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": num_effective / duration_s,
        "goodput": num_effective / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_slo_ms": ttft_slo_s * 1000.0,
        "tbt_slo_ms": tbt_slo_s * 1000.0,
        "num_effective_requests": num_effective,
        "effective_request_capacity": num_effective / len(results) if results else 0.0,
    }
    report |= _distribution("ttft", [r.ttft_s for r in done if r.ttft_s is not None])
    report |= _distribution("tpot", [t for r in done if (t := tpot_s(r)) is not None])
    report |= _distribution("itl", [g for r in done for g in r.gaps_s])
    report |= _distribution("tbt", [paper_tbt_s(r.gaps_s) for r in done])
    report |= _distribution("e2el", [r.latency_s for r in done if r.latency_s is not None])
    error_messages = sorted({r.error for r in results if r.outcome is Outcome.ERROR})
    report["error_messages"] = error_messages[:20]
    return report
