r"""`kvcake serve` vs vLLM's CPU build on this machine: the same weights, the same workload.

    bash ../shared/tools/peers/vllm_cpu_setup.sh        # once: /tmp/vllmcpu-venv, tokenizer dir
    .venv/bin/python benchmarks/serving_vs_vllm.py       # defaults: a few minutes on 2 cores
    .venv/bin/python benchmarks/serving_vs_vllm.py --systems kvcake-single,kvcake-disagg,vllm \
        --trace-requests 24 --rate 0.25 --out /tmp/serving_vs_vllm.json
    .venv/bin/python benchmarks/serving_vs_vllm.py --systems vllm:float32,vllm:bfloat16 \
        --trace-requests 1       # which dtype vLLM runs best in here (KIND:DTYPE)
    .venv/bin/python benchmarks/serving_vs_vllm.py --systems kvcake-single,vllm:float32 \
        --json-summary --repeats 4   # A B, B A, A B, B A: medians, spread, order effect

One model directory serves both: the peer setup's config.json and WordLevel tokenizer (vocab
32000) plus seeded random weights that this script writes as `model.safetensors` (vLLM loads
them with `--load-format safetensors`, not dummy weights). The systems run one at a time on
127.0.0.1 (never two at once: 2 cores), each started, waited for on /health, given the same
warm-up, measured, then stopped, and waited for until every process of its session has exited
(vLLM's engine core and worker too; `kvcake/bench/proctree.py`). Before each start the host's
CPU busy share over `--settle-s`, free memory and one core's speed are recorded. With
`--repeats N` the systems run N times in alternating order and every figure is the per-system
median (min-max shown), so whichever system runs second is not systematically favoured:

- `kvcake-single`: `kvcake serve --mode single` (one engine in the frontend process), the fair
  match for one vLLM server; `--kvcake-threads` torch threads (2: vLLM's worker gets both cores).
- `kvcake-disagg`: `kvcake serve --config` with 1 prefill + 1 decode worker (one thread each).
- `vllm`: `vllm_cpu_serve.sh start` (the peer launcher: OpenMP bound to cores 0-1, tcmalloc,
  prefix caching, chunked prefill at 2048 tokens).

Every system runs in `--kvcake-dtype` / `--vllm-dtype` unless its entry says `KIND:DTYPE`; ratios
are against the first vLLM entry.

Workload, identical for every system (token-id prompts, `ignore_eos` + `min_tokens` so every
request yields exactly the asked number of tokens; checked):
1. probe: per trial a fresh random `--probe-prompt-len` prompt with `--probe-max-tokens` out, sent
   cold, then the same prompt again (prefix hit); TTFT cold/repeat, mean TBT (gaps of the cold
   request), e2e cold; medians over `--probe-trials`.
2. trace: the first `--trace-requests` records of the conversation trace, lengths scaled by
   `--scale-tokens` (prefix sharing kept, `kvcake/bench/prompts.py`), sent at a fixed `--rate`;
   TTFT and the paper's TBT (mean of a request's slowest 10% of gaps) p50/p90, output tokens/s.
Prefix-cache hit tokens are the delta of each server's `prefix_cache_hits_total` counter.
Printed: one column per system and ours / vLLM ratios (lower is better for times).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_servers import (  # noqa: E402
    BIND_CHOICES,
    KINDS,
    ROOT,
    System,
    parse_systems,
    prepare_model,
    start,
    stop,
)
from serving_probes import probe, run_trace, trace_workload, ttft_sweep, warm_up  # noqa: E402
from serving_report import (  # noqa: E402
    MEDIAN_PATHS,
    print_positions,
    print_runs,
    print_sweep,
    print_table,
    summary_ratios,
)

from kvcake.bench.hoststate import busy_share, cpu_times, settle, steal_share  # noqa: E402
from kvcake.bench.repeats import alternating_orders, median_result, spread  # noqa: E402
from kvcake.bench.replay import PlannedRequest  # noqa: E402


def measure(system: System, args: argparse.Namespace, port: int, run_dir: Path, vocab_size: int,
            planned: list[PlannedRequest] | None) -> dict[str, Any]:
    name = system.label
    host = settle(args.settle_s)  # after the previous system is gone: how quiet is the host now
    print(f"[{name}] host before start: {json.dumps(host.as_dict())}; starting on port {port}",
          file=sys.stderr, flush=True)
    server = start(system, args, port, run_dir)
    result: dict[str, Any] = {"host_before": host.as_dict()}
    try:
        model = str(httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"])
        print(f"[{name}] healthy after {server.startup_s:.1f} s; warm-up", file=sys.stderr,
              flush=True)
        warm_up(server.url, model, vocab_size, args.seed)
        during = cpu_times()
        result.update({"startup_s": server.startup_s,
                       "probe": probe(server.url, model, args, vocab_size)})
        shown = {k: v for k, v in result["probe"].items() if k != "trials"}
        print(f"[{name}] probe: {json.dumps(shown)}", file=sys.stderr, flush=True)
        if args.ttft_sweep:
            result["ttft_sweep"] = ttft_sweep(server.url, model, args, vocab_size, server.sid)
            print(f"[{name}] ttft sweep: {json.dumps(result['ttft_sweep'])}", file=sys.stderr,
                  flush=True)
        if planned is not None:
            result["trace"] = run_trace(server.url, model, planned, args)
            shown = {k: v for k, v in result["trace"].items() if k != "requests"}
            print(f"[{name}] trace: {json.dumps(shown)}", file=sys.stderr, flush=True)
        after = cpu_times()  # the measured part (probe + trace): busy with us, stolen by others
        result["host_during"] = {"cpu_busy": busy_share(during, after),
                                 "steal": steal_share(during, after)}
    finally:
        gone = stop(server, args, port, run_dir)
    result["teardown"] = None if gone is None else gone.as_dict()
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _system_flags(p)
    _workload_flags(p)
    _run_flags(p)
    args = p.parse_args()
    try:
        args.systems = parse_systems(args.systems, args.kvcake_dtype, args.vllm_dtype)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("probe_prompt_len", "probe_max_tokens", "probe_trials", "trace_requests",
                 "max_prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.rate > 0 and args.scale_tokens > 0):
        p.error("--rate and --scale-tokens must be > 0")
    if args.settle_s < 0:
        p.error(f"--settle-s must be >= 0, got {args.settle_s}")
    if args.probe_prompt_len + args.probe_max_tokens > args.max_model_len:
        p.error("--probe-prompt-len + --probe-max-tokens must fit in --max-model-len")
    args.model_dir = args.model_dir.resolve()
    return args


def _system_flags(p: argparse.ArgumentParser) -> None:
    """Which systems, with which model, threads and binding."""
    p.add_argument("--systems", default="kvcake-single,vllm",
                   help=f"comma-separated KIND[:DTYPE], run in this order; KIND of "
                        f"{', '.join(KINDS)}")
    p.add_argument("--tokenizer-dir", type=Path, default=Path("/tmp/vllm-tiny-llama"),
                   help="config.json + tokenizer.json from the peer setup script")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kvcake-vs-vllm-model"),
                   help="written here: that config, tokenizer and seeded weights")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts")
    p.add_argument("--kvcake-dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--kvcake-threads", type=int, default=2,
                   help="torch threads of --mode single (default: as many as vLLM's worker gets "
                        "with bind 0-1; 1 is faster when the cores are busy with other work); "
                        "the disaggregated workers use 1 each")
    p.add_argument("--kvcake-bind", choices=BIND_CHOICES, default="default",
                   help="kvcake-single's thread binding: default (no flag: `kvcake serve`'s "
                        "own default), all (--bind-threads --bind-engine-thread), workers "
                        "(--bind-threads --no-bind-engine-thread: torch's worker threads "
                        "only), off (--no-bind-threads)")
    p.add_argument("--kvcake-bind-threads", action="store_const", const="all", dest="kvcake_bind",
                   help="the same as --kvcake-bind all")
    p.add_argument("--kvcake-serve-args", default="",
                   help="more `kvcake serve --mode single` flags, one string (diagnostics, e.g. "
                   "'--switch-interval-ms 0.5'); with $KVCAKE_STEP_TRACE=DIR the server writes "
                   "its per-step trace there")
    p.add_argument("--vllm-dtype", default="float32",
                   help="fp32: 3-4x faster prefill than bf16 on a CPU without AVX512-BF16/AMX "
                        "(docs/benchmarks.md); the peer launcher's own default is bfloat16")
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")


def _workload_flags(p: argparse.ArgumentParser) -> None:
    """The probe and the trace every system is given."""
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--probe-prompt-len", type=int, default=2048)
    p.add_argument("--probe-max-tokens", type=int, default=64)
    p.add_argument("--probe-trials", type=int, default=3)
    p.add_argument("--trace", type=Path,
                   default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    p.add_argument("--trace-requests", type=int, default=16)
    p.add_argument("--scale-tokens", type=float, default=1 / 8,
                   help="trace lengths x this; 1/8: a 512-token trace block is 64 tokens (4 of "
                        "our blocks, half of one of vLLM's 128-token CPU blocks)")
    p.add_argument("--max-prompt-len", type=int, default=4096, help="trace prompts cut to this")
    p.add_argument("--rate", type=float, default=0.25, help="trace requests per second")
    p.add_argument("--ttft-slo-s", type=float, default=5.0)
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)


def _run_flags(p: argparse.ArgumentParser) -> None:
    """Ports, repeats, settling, the TTFT sweep and the output."""
    p.add_argument("--port-base", type=int, default=23000,
                   help="system i uses ports base+10i .. base+10i+3")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/kvcake-vs-vllm-run"))
    p.add_argument("--repeats", type=int, default=1,
                   help="run the systems this many times in alternating order (1: the --systems "
                        "order; 2: A B, B A; 4: A B B A A B B A); every system restarts and gets "
                        "the same warm-up, probe and trace each time; tables and --json-summary "
                        "use per-system medians, and each repeat's ratios are printed too")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="before each system starts, after the previous one's processes have all "
                        "exited: wait this long and record the host's CPU busy share, free memory "
                        "and one core's speed")
    p.add_argument("--ttft-sweep", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[], metavar="LENS",
                   help="diagnostic, before the trace: cold prompts of these lengths (e.g. "
                        "256,845,2048) sent one at a time, the client's and the server's own "
                        "TTFT (and vLLM's queue / prefill time) per length; printed per system")
    p.add_argument("--sweep-trials", type=int, default=3, help="prompts per --ttft-sweep length")
    p.add_argument("--sweep-idle-s", type=float, default=0.0,
                   help="--ttft-sweep: leave the server idle this long before each prompt (the "
                        "trace at 0.25/s leaves it idle ~3 s between requests)")
    p.add_argument("--out", type=Path, help="write all results as JSON here")
    p.add_argument("--json-summary", action="store_true",
                   help='print one last line {"ratios": {...}}: the first kvcake system / the '
                        'first vLLM system for probe_ttft_cold, probe_mean_tbt, trace_ttft_p50, '
                        'trace_ttft_p90, trace_tbt_p50, trace_tbt_p90 (null when not measured), '
                        'of the per-system medians over --repeats; also "ratios_per_run"')


def exit_on_sigterm(signum: int, frame: object) -> None:
    """`timeout`/`kill` of the benchmark: unwind, so that the running server is stopped too."""
    raise SystemExit(128 + signum)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    config = prepare_model(args.tokenizer_dir, args.model_dir, args.seed)
    planned = trace_workload(args, config.vocab_size)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    ports = {s.label: args.port_base + 10 * i for i, s in enumerate(args.systems)}
    by_label = {s.label: s for s in args.systems}
    runs: list[dict[str, Any]] = []
    for repeat, order in enumerate(alternating_orders(list(by_label), args.repeats)):
        print(f"repeat {repeat + 1}/{args.repeats}: {' > '.join(order)}", file=sys.stderr,
              flush=True)
        results = {label: measure(by_label[label], args, ports[label], args.run_dir,
                                  config.vocab_size, planned) for label in order}
        results = {s.label: results[s.label] for s in args.systems}  # columns in --systems order
        runs.append({"repeat": repeat + 1, "order": order, "results": results,
                     "ratios": summary_ratios(results)})
        if args.out is not None and repeat + 1 < args.repeats:  # kept if a later one fails
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "started": started, "partial": True, "runs": runs},
                                           indent=2) + "\n")
    load_after = os.getloadavg()
    per_system = {s.label: [run["results"][s.label] for run in runs] for s in args.systems}
    medians = {label: median_result(rs, MEDIAN_PATHS) for label, rs in per_system.items()}
    print(f"{started}; load average before {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} "
          f"{load_after[2]:.2f}; kvcake single {args.kvcake_threads} torch thread(s) (bind "
          f"{args.kvcake_bind}), vLLM "
          f"OpenMP bind {args.vllm_bind}; {args.repeats} repeat(s), alternating order")
    if planned is not None:
        num_out = sum(p.max_tokens for p in planned)
        num_in = sum(len(p.prompt_token_ids) for p in planned)
        print(f"trace: {len(planned)} requests at {args.rate:g}/s, {num_in} prompt and "
              f"{num_out} output tokens (scale {args.scale_tokens:g})")
    print_table(per_system)
    if args.ttft_sweep:
        print()
        print_sweep(per_system)
    print()
    print_runs(runs)
    if args.repeats > 1 and len(args.systems) == 2:
        print()
        print_positions(runs, list(by_label))
    summary = {"ratios": summary_ratios(medians), "repeats": args.repeats,
               "ratios_per_run": [run["ratios"] for run in runs]}
    if args.out is not None:
        spreads = {label: {path: found.as_dict() for path in MEDIAN_PATHS
                           if (found := spread(rs, path)) is not None}
                   for label, rs in per_system.items()}
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "started": started, "load_before": load_before,
                                        "load_after": load_after, "runs": runs,
                                        "medians": medians, "spreads": spreads, **summary},
                                       indent=2) + "\n")
    if args.json_summary:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
