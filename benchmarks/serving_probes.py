"""What `benchmarks/serving_vs_vllm.py` measures on one started server: the warm-up, the
single-request probe (cold and warm TTFT, token gaps, prefix hits), the TTFT sweep over prompt
lengths with the server's own histograms, and the trace replay (its workload from a trace file).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_servers import session_run_ns  # noqa: E402

from kvcake.bench.prompts import PromptBuilder  # noqa: E402
from kvcake.bench.replay import PlannedRequest, ReplayConfig, plan, replay  # noqa: E402
from kvcake.bench.stats import Outcome, RequestResult, summarize  # noqa: E402
from kvcake.sim.trace import load_trace  # noqa: E402


def prefix_hits(url: str) -> float | None:
    """The server's prefix_cache_hits_total (vllm: or kvcake: prefix), summed over labels."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    found = re.findall(r"^(?:vllm:|kvcake:)prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text,
                       re.MULTILINE)
    return sum(float(v) for v in found) if found else None


def hits_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def send(url: str, model: str, planned: list[PlannedRequest]) -> tuple[list[RequestResult], float]:
    results, duration_s = asyncio.run(replay(planned, ReplayConfig(url, model)))
    for p, r in zip(planned, results, strict=True):
        if r.outcome is not Outcome.OK:
            raise RuntimeError(f"{url}: request failed: {r.error}")
        if r.output_len != p.max_tokens:  # ignore_eos + min_tokens must make lengths exact
            raise RuntimeError(f"{url}: asked {p.max_tokens} tokens, got {r.output_len}")
    return results, duration_s


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(4, vocab_size - 256) for _ in range(length)]


def warm_up(url: str, model: str, vocab_size: int, seed: int) -> None:
    """The same for every system: one prompt per length in sequence, then 4 at once."""
    rng = random.Random(seed + 1_000_003)
    for length in (16, 512, 2048):
        send(url, model, [PlannedRequest(0.0, random_prompt(rng, length, vocab_size), 8)])
    send(url, model, [PlannedRequest(0.0, random_prompt(rng, 256, vocab_size), 8)
                      for _ in range(4)])


def probe(url: str, model: str, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    for _ in range(args.probe_trials):
        prompt = random_prompt(rng, args.probe_prompt_len, vocab_size)
        request = PlannedRequest(0.0, prompt, args.probe_max_tokens)
        h0 = prefix_hits(url)
        [cold], _ = send(url, model, [request])
        h1 = prefix_hits(url)
        [repeat], _ = send(url, model, [request])
        h2 = prefix_hits(url)
        assert cold.ttft_s is not None and repeat.ttft_s is not None and cold.latency_s
        rows.append({"ttft_cold_ms": 1000 * cold.ttft_s, "ttft_repeat_ms": 1000 * repeat.ttft_s,
                     "mean_tbt_ms": 1000 * statistics.fmean(cold.gaps_s),
                     "e2e_cold_ms": 1000 * cold.latency_s, "chunks": 1 + len(cold.gaps_s),
                     "hit_tokens_cold": hits_delta(h0, h1),
                     "hit_tokens_repeat": hits_delta(h1, h2)})
    summary: dict[str, Any] = {k: statistics.median(r[k] for r in rows)
                               for k in ("ttft_cold_ms", "ttft_repeat_ms", "mean_tbt_ms",
                                         "e2e_cold_ms", "chunks")}
    for k in ("hit_tokens_cold", "hit_tokens_repeat"):
        values = [r[k] for r in rows if r[k] is not None]
        summary[k] = statistics.median(values) if values else None
    summary["trials"] = rows
    return summary


SERVER_HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds")


def histogram_sums(url: str) -> dict[str, float]:
    """The server's own per-request histograms (vllm: or kvcake: prefix), `_sum` over labels:
    the delta around one request sent alone is that request's value."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    sums: dict[str, float] = {}
    for name in SERVER_HISTOGRAMS:
        found = re.findall(rf"^(?:vllm:|kvcake:){name}_sum(?:\{{[^}}]*\}})? (\S+)$", text,
                           re.MULTILINE)
        if found:
            sums[name] = sum(float(v) for v in found)
    return sums


def ttft_sweep(url: str, model: str, args: argparse.Namespace,
               vocab_size: int, sid: int | None = None) -> dict[str, Any]:
    """Diagnostic (`--ttft-sweep`): fresh random prompts of each length sent one at a time to the
    idle server (cold: no prefix to reuse), 2 tokens out. Per length the medians of the client's
    TTFT, the server's own TTFT (arrival to first token) and, where the server exports them, its
    queue and prefill time; the client minus the server TTFT is the HTTP and framing outside.
    `--sweep-idle-s`: the server left idle that long before each prompt, as between the trace's
    requests (threads asleep, caches cold). With the server's session id: the CPU time all its
    processes' threads ran during the request (`server_cpu_ms`) and that over the server's TTFT
    (`server_cores`: about 2 when both compute threads ran side by side, about 1 when they
    shared one core)."""
    rng = random.Random(args.seed + 7)
    out: dict[str, Any] = {}
    for length in args.ttft_sweep:
        rows: list[dict[str, float]] = []
        for _ in range(args.sweep_trials):
            time.sleep(args.sweep_idle_s)  # as in the trace: the server idle before a request
            before = histogram_sums(url)
            cpu_before = session_run_ns(sid)
            [r], _ = send(url, model, [PlannedRequest(0.0, random_prompt(rng, length, vocab_size),
                                                      2)])
            cpu_after = session_run_ns(sid)
            after = histogram_sums(url)
            assert r.ttft_s is not None
            row = {"client_ttft_ms": 1000 * r.ttft_s}
            row.update({f"server_{k.removesuffix('_seconds')}_ms": 1000 * (after[k] - before[k])
                        for k in after if k in before})
            if cpu_before is not None and cpu_after is not None:
                row["server_cpu_ms"] = (cpu_after - cpu_before) / 1e6
                server_ttft = row.get("server_time_to_first_token_ms")
                if server_ttft:  # the request's CPU includes its second token and the HTTP side
                    row["server_cores"] = row["server_cpu_ms"] / server_ttft
            rows.append(row)
        out[str(length)] = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]
                            if all(k in r for r in rows)}
    return out


def trace_workload(args: argparse.Namespace, vocab_size: int) -> list[PlannedRequest] | None:
    if not args.trace.is_file():
        print(f"trace: {args.trace} not found; skipping the trace replay (pass --trace FILE)",
              file=sys.stderr)
        return None
    records = list(load_trace(args.trace).sampled(first=args.trace_requests).requests)
    builder = PromptBuilder(vocab_size=vocab_size, scale_tokens=args.scale_tokens, seed=args.seed)
    planned = plan(records, builder, speed=1.0)
    # A fixed request rate instead of the trace's arrival times; prompts cut to --max-prompt-len
    # (the head is kept, so is the prefix sharing) and to the context.
    room = min(args.max_prompt_len, args.max_model_len - max(p.max_tokens for p in planned))
    return [replace(p, send_at_s=i / args.rate, prompt_token_ids=p.prompt_token_ids[:room])
            for i, p in enumerate(planned)]


def run_trace(url: str, model: str, planned: list[PlannedRequest],
              args: argparse.Namespace) -> dict[str, Any]:
    before = prefix_hits(url)
    results, duration_s = send(url, model, planned)
    report = summarize(results, duration_s, args.ttft_slo_s, args.tbt_slo_ms / 1000.0)
    keys = ("median_ttft_ms", "p90_ttft_ms", "median_tbt_ms", "p90_tbt_ms", "median_itl_ms",
            "output_throughput", "duration", "total_input_tokens", "total_output_tokens",
            "effective_request_capacity")
    out: dict[str, Any] = {k: report[k] for k in keys}
    out["hit_tokens"] = hits_delta(before, prefix_hits(url))
    # per request, for --out: where a TTFT p90 comes from (queueing behind a long prefill?)
    out["requests"] = [{"send_at_s": p.send_at_s, "prompt_len": r.prompt_len,
                        "output_len": r.output_len,
                        "ttft_ms": None if r.ttft_s is None else round(1000 * r.ttft_s, 2),
                        "max_gap_ms": round(1000 * max(r.gaps_s), 2) if r.gaps_s else None}
                       for p, r in zip(planned, results, strict=True)]
    return out
