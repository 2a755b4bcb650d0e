"""`kvcake bench`: replay a Mooncake trace against an OpenAI-compatible server; report as JSON.

The JSON (stdout, and `bench.json` under --out with the CDF plots) uses `vllm bench serve`
field names; see `kvcake/bench/stats.py` for the definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvcake.bench.capacity import find_capacity
from kvcake.bench.plots import plot_cdfs
from kvcake.bench.prompts import DEFAULT_VOCAB_SIZE, PromptBuilder
from kvcake.bench.replay import ReplayConfig, fetch_model_info, plan, replay
from kvcake.bench.stats import RequestResult, per_request, summarize
from kvcake.sim.trace import TraceRequest, load_trace


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one `kvcake bench` run; the CLI reads its defaults from here."""

    speed: float = 1.0
    max_requests: int | None = None
    scale_tokens: float = 1.0
    seed: int = 0
    ttft_slo_s: float = 30.0
    tbt_slo_ms: float = 100.0
    capacity_target: float = 0.9
    max_capacity_probes: int = 8

    def __post_init__(self) -> None:
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        for name in ("speed", "scale_tokens", "ttft_slo_s", "tbt_slo_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got "
                                 f"{getattr(self, name)}")


def register(subparsers: Any) -> None:
    d = BenchConfig()
    p = subparsers.add_parser("bench", help="replay a Mooncake trace against an OpenAI server",
                              description=__doc__)
    p.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL trace")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--speed", type=float, default=d.speed,
                   help="divide the trace's arrival times by this (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="replay only the first N records")
    p.add_argument("--scale-tokens", type=float, default=d.scale_tokens,
                   help="scale every prompt/output length and the 512-token block by F")
    p.add_argument("--model", help="model name to send (default: the server's first model)")
    p.add_argument("--vocab-size", type=int,
                   help=f"token ids stay below this (default: from the server, else "
                        f"{DEFAULT_VOCAB_SIZE})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompt tokens")
    p.add_argument("--ttft-slo-s", type=float, default=d.ttft_slo_s)
    p.add_argument("--tbt-slo-ms", type=float, default=d.tbt_slo_ms)
    p.add_argument("--out", type=Path, help="write bench.json and CDF plots into DIR")
    p.add_argument("--find-capacity", action="store_true",
                   help=f"search the highest speed at which >= {d.capacity_target * 100:g}%% "
                        "of requests meet both SLOs")
    p.add_argument("--max-capacity-probes", type=int, default=d.max_capacity_probes)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = BenchConfig(speed=args.speed, max_requests=args.max_requests,
                         scale_tokens=args.scale_tokens, seed=args.seed,
                         ttft_slo_s=args.ttft_slo_s, tbt_slo_ms=args.tbt_slo_ms,
                         max_capacity_probes=args.max_capacity_probes)
    trace = load_trace(args.trace)
    if config.max_requests is not None and config.max_requests < len(trace):
        trace = trace.sampled(first=config.max_requests)
    records = list(trace.requests)
    if not records:
        raise ValueError(f"--trace: {args.trace} holds no records")
    info = asyncio.run(fetch_model_info(args.url))
    model = args.model or str(info["id"])
    vocab_size = args.vocab_size or int(info.get("vocab_size") or DEFAULT_VOCAB_SIZE)
    builder = PromptBuilder(vocab_size=vocab_size, scale_tokens=config.scale_tokens,
                            seed=config.seed)
    report = bench_once(records, builder, ReplayConfig(args.url, model, config.speed), config,
                        args.out)
    if args.find_capacity:
        report["capacity"] = search_capacity(records, builder, args.url, model, config)
    report["model"] = model
    print(json.dumps(report, indent=2))
    return 0


def bench_once(records: list[TraceRequest], builder: PromptBuilder, replay_config: ReplayConfig,
               config: BenchConfig, out_dir: Path | None) -> dict[str, Any]:
    planned = plan(records, builder, replay_config.speed)
    show = sys.stderr.isatty() and len(planned) >= 20
    with tqdm(total=len(planned), disable=not show, desc="requests", file=sys.stderr) as bar:
        on_done: Callable[[RequestResult], None] = lambda _result: bar.update(1)  # noqa: E731
        results, duration_s = asyncio.run(replay(planned, replay_config, on_done=on_done))
    report = summarize(results, duration_s, config.ttft_slo_s, config.tbt_slo_ms / 1000.0)
    report["speed"] = replay_config.speed
    report["scale_tokens"] = builder.scale_tokens
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        saved = report | per_request(results)  # the per-request arrays go to the file only
        (out_dir / "bench.json").write_text(json.dumps(saved, indent=2) + "\n")
        plot_cdfs(results, out_dir, config.ttft_slo_s, config.tbt_slo_ms / 1000.0,
                  title=f"(speed {replay_config.speed:g})")
    return report


def search_capacity(records: list[TraceRequest], builder: PromptBuilder, url: str, model: str,
                    config: BenchConfig) -> dict[str, Any]:
    span_s = (max(r.timestamp_ms for r in records) - min(r.timestamp_ms for r in records)) / 1000.0

    def probe(speed: float) -> float:
        report = bench_once(records, builder, ReplayConfig(url, model, speed), config, None)
        print(f"capacity probe: speed {speed:.3g} -> effective share "
              f"{report['effective_request_capacity']:.2f}", file=sys.stderr)
        return float(report["effective_request_capacity"])

    found = find_capacity(probe, config.speed, config.capacity_target, config.max_capacity_probes)

    def rate(speed: float | None) -> float | None:
        return None if speed is None or span_s == 0 else (len(records) - 1) / (span_s / speed)

    return {
        "target_effective_share": config.capacity_target,
        "best_speed": found.best_speed,
        "best_request_rate": rate(found.best_speed),
        "probes": [{"speed": p.speed, "request_rate": rate(p.speed),
                    "effective_request_capacity": p.share} for p in found.probes],
    }
