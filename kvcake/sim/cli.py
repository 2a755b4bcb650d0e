"""`kvcake simulate`, `kvcake reproduce` and `kvcake trace {stats,gen}`.

Defaults come from `SimConfig`. A bad flag ends with exit status 2 and one line on stderr that
names the flag (argparse's usage block is not printed); a bad value that only the config can
judge raises ValueError, which `kvcake.cli` turns into the same one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from kvcake.sim.config import POLICIES, SimConfig
from kvcake.sim.trace import load_trace

_D = SimConfig()
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int:
    """A token count such as 3000000, 3M or 500k (decimal suffixes)."""
    raw = text.strip().lower()
    unit = raw[-1:] if raw[-1:] in _SUFFIXES else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number) * _SUFFIXES[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a token count; write e.g. 3000000, 3M or 500k") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"a token count must be >= 0, got {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _hardware_override(text: str) -> tuple[str, float]:
    name, eq, value = text.partition("=")
    try:
        if not eq:
            raise ValueError
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected FIELD=NUMBER (a hardware profile field), got {text!r}") from None


def _one_line_errors(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    def error(message: str) -> NoReturn:
        print(f"kvcake {name}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]
    return parser


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by `simulate` and `reproduce` (the cluster and the load)."""
    p.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    p.add_argument("--profile", default=_D.profile, help="MODEL@HARDWARE cost profile")
    p.add_argument("--speed", type=_positive_float, default=_D.speed,
                   help="replay speed: arrival times are divided by this")
    p.add_argument("--max-requests", type=_positive_int, default=None,
                   help="simulate only the first N requests")
    p.add_argument("--seed", type=int, default=_D.seed, help="seed of all randomness")
    p.add_argument("--ttft-slo-s", type=_positive_float, default=_D.ttft_slo_s)
    p.add_argument("--tbt-slo-ms", type=_positive_float, default=_D.tbt_slo_ms)
    p.add_argument("--cpp-min-tokens", type=parse_tokens, default=_D.cpp_min_tokens,
                   help="chunked pipeline parallelism: prompts of at least N tokens are "
                        "prefilled by a group of --cpp-nodes prefill nodes (default: off)")
    p.add_argument("--cpp-nodes", type=_positive_int, default=_D.cpp_nodes,
                   help="prefill nodes per CPP group (X)")
    p.add_argument("--cpp-chunk-tokens", type=_positive_int, default=_D.cpp_chunk_tokens,
                   help="tokens per CPP chunk (>= 1000)")


def register(subparsers: Any) -> None:
    """`kvcake simulate`, `kvcake reproduce` and `kvcake trace {stats,gen}`."""
    _register_simulate(subparsers)
    _register_reproduce(subparsers)
    _register_trace(subparsers)


def _register_simulate(subparsers: Any) -> None:
    sim = _one_line_errors(subparsers.add_parser(
        "simulate", help="run a trace on a simulated cluster driven by the Conductor"), "simulate")
    add_cluster_flags(sim)
    sim.add_argument("--prefill", type=_positive_int, default=_D.num_prefill,
                     help="prefill instances (nodes)")
    sim.add_argument("--decode", type=_positive_int, default=_D.num_decode,
                     help="decode instances (nodes)")
    sim.add_argument("--policy", choices=POLICIES, default=_D.policy)
    sim.add_argument("--admission",
                     choices=("none", "slo", "early", "prediction", "decode_after_prefill"),
                     default=_D.admission,
                     help="when the Conductor rejects (colocated never rejects): slo = the decode "
                          "load now; early (= prediction) = forecast at prefill end; "
                          "decode_after_prefill = TBT checked once the prefill is spent")
    sim.add_argument("--decode-check-after-prefill", action="store_true",
                     help="admission slo / early: the decode side also checks its TBT SLO when "
                          "the prefill ends (rejecting there, prefill spent)")
    sim.add_argument("--decode-node-guard", action="store_true",
                     help="with a decode check after prefill: a decode node takes a request only "
                          "if it can start it at once, and reports its KV to the Conductor")
    sim.add_argument("--decode-reselect-at-handoff", action="store_true",
                     help="where the arrival decision is final: hand a prefilled request to the "
                          "decode node chosen at arrival if it can start it, else to the one with the "
                          "most room that can (its KV sent again), else wait at the first")
    sim.add_argument("--decode-check-keeps-node", action="store_true",
                     help="the decode check after prefill asks only the decode node chosen at "
                          "arrival (its KV streamed there): decode there or be rejected")
    _add_prediction_flags(sim)
    sim.add_argument("--local-cache-tokens", type=parse_tokens, default=None,
                     help="prefix cache per prefill node (default: the node's DRAM)")
    sim.add_argument("--store-tokens", type=parse_tokens, default=_D.store_tokens,
                     help="pooled store tier on the decode nodes (0: off)")
    sim.add_argument("--nic-gbps", type=_positive_float, default=None,
                     help="per-node NIC bandwidth in Gbit/s (default: the profile's)")
    sim.add_argument("--chunked-prefill", action="store_true",
                     help="colocated: prefill chunks piggy-back on decode steps")
    sim.add_argument("--chunk-budget-tokens", type=_positive_int, default=_D.chunk_budget_tokens)
    sim.add_argument("--no-prefix-cache", action="store_true",
                     help="colocated: no HBM prefix cache (plain vLLM)")
    sim.add_argument("--max-batch-size", type=_positive_int, default=_D.max_batch_size)
    sim.add_argument("--hardware-override", action="append", default=[], metavar="FIELD=VALUE",
                     type=_hardware_override,
                     help="replace one hardware profile field, e.g. decode_step_overhead_s=0.02 "
                          "(repeatable; the calibration and sensitivity runs)")
    sim.add_argument("--live-profile", type=Path, default=None, metavar="FILE",
                     help="costs fitted on the live engine instead of --profile: `kvcake "
                          "profile`'s JSON plus a \"live\" object (kvcake/sim/live_profile.py)")
    sim.add_argument("--records", type=Path, default=None, help="write per-request JSONL here")
    sim.add_argument("--plot", type=Path, default=None, help="write a PNG of TTFT and TBT here")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(func=_simulate)


def _add_prediction_flags(sim: argparse.ArgumentParser) -> None:
    """What the simulated Conductor predicts with: the told output length, t_d, prediction
    error, the fetch threshold and the learned prefill speed."""
    sim.add_argument("--prefill-speed-weight", type=float, default=0.0,
                     help="the Conductor learns each prefill instance's speed from its finished "
                          "prefills with this weight (0..1; 0: the fitted prediction as is)")
    sim.add_argument("--predicted-output-len", type=_positive_int, default=None,
                     help="output length the Conductor is told (default: the trace's mean)")
    sim.add_argument("--uniform-decode-s", type=_positive_float, default=None,
                     help="the Conductor's uniform decode time t_d per request (default: "
                          "predicted steps)")
    sim.add_argument("--prefill-prediction-error", type=float, default=0.0,
                     help="seeded multiplicative error of prefill predictions (0.1 = +-10%%)")
    sim.add_argument("--kvcache-balancing-threshold", type=float,
                     default=_D.kvcache_balancing_threshold)


def _register_reproduce(subparsers: Any) -> None:
    from kvcake.sim.reproduce import EXPERIMENTS

    rep = _one_line_errors(subparsers.add_parser(
        "reproduce", help="rerun one of the paper's experiments; write a report and a PNG"),
        "reproduce")
    rep.add_argument("experiment", choices=sorted(EXPERIMENTS))
    add_cluster_flags(rep)
    rep.add_argument("--out", type=Path, required=True, help="directory for the report and PNG")
    rep.add_argument("--decode-reselect-at-handoff", action="store_true",
                     help="overload: early and prediction hand a prefilled request to the decode "
                          "node chosen at arrival if it can start it, else to the one with the "
                          "most room that can (its KV sent again), else wait at the first")
    rep.add_argument("--decode-check-keeps-node", action="store_true",
                     help="overload: the baseline's decode check after prefill asks only the "
                          "decode node chosen at arrival: decode there or be rejected")
    rep.add_argument("--json", action="store_true",
                     help="print the experiment's numbers as one JSON object (not the path)")
    rep.set_defaults(func=_reproduce)


def _register_trace(subparsers: Any) -> None:
    trace = _one_line_errors(subparsers.add_parser("trace", help="Mooncake trace tools"), "trace")
    sub = trace.add_subparsers(dest="trace_command", metavar="{stats,gen}")
    sub.required = True
    stats = _one_line_errors(sub.add_parser("stats", help="Table 2 statistics of a trace"),
                             "trace stats")
    stats.add_argument("file", type=Path)
    stats.set_defaults(func=_trace_stats)
    gen = _one_line_errors(sub.add_parser("gen", help="write a seeded synthetic trace"),
                           "trace gen")
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--num-requests", type=_positive_int, default=1000)
    gen.add_argument("--rate-per-s", type=_positive_float, default=3.4)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="any other generator field (kvcake/sim/tracegen.py TraceGenConfig), "
                          "repeatable; e.g. a tool-and-agent shape: --set system_prompt_len=6144 "
                          "--set num_system_prompts=2 --set mean_output_len=24")
    gen.set_defaults(func=_trace_gen)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        num_prefill=args.prefill, num_decode=args.decode, policy=args.policy,
        profile=args.profile, speed=args.speed, ttft_slo_s=args.ttft_slo_s,
        tbt_slo_ms=args.tbt_slo_ms, seed=args.seed, max_requests=args.max_requests,
        kvcache_balancing_threshold=args.kvcache_balancing_threshold, admission=args.admission,
        local_cache_tokens=args.local_cache_tokens, store_tokens=args.store_tokens,
        nic_gbps=args.nic_gbps, chunked_prefill=args.chunked_prefill,
        chunk_budget_tokens=args.chunk_budget_tokens, prefix_cache=not args.no_prefix_cache,
        max_batch_size=args.max_batch_size, cpp_min_tokens=args.cpp_min_tokens,
        cpp_nodes=args.cpp_nodes, cpp_chunk_tokens=args.cpp_chunk_tokens,
        predicted_output_len=args.predicted_output_len, uniform_decode_s=args.uniform_decode_s,
        prefill_prediction_error=args.prefill_prediction_error,
        hardware_overrides=tuple(args.hardware_override),
        decode_check_after_prefill=args.decode_check_after_prefill,
        decode_node_guard=args.decode_node_guard,
        decode_reselect_at_handoff=args.decode_reselect_at_handoff,
        decode_check_keeps_node=args.decode_check_keeps_node,
        prefill_speed_weight=args.prefill_speed_weight,
    )


def _simulate(args: argparse.Namespace) -> int:
    from kvcake.sim.records import write_records
    from kvcake.sim.run import simulate

    config = config_from_args(args)  # validate flags before reading a large trace
    cost = None
    if args.live_profile is not None:
        from kvcake.sim.live_profile import load_live_profile

        cost = load_live_profile(args.live_profile).as_cost_model()
    result = simulate(config, load_trace(args.trace), cost)
    if args.records is not None:
        write_records(args.records, result.states)
    if args.plot is not None:
        from kvcake.sim.plots import plot_run

        plot_run(result.states, args.plot, title=f"{config.policy} on {args.trace.name}")
    if args.json:
        print(json.dumps(result.summary, sort_keys=True))
    else:
        print(format_summary(result.summary))
    return 0


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for key, value in summary.items():
        if isinstance(value, dict) and set(value) == {"mean", "p50", "p90", "p99"}:
            value = "  ".join(f"{k} {v:.4g}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.4g}"
        lines.append(f"{key:28s} {value}")
    return "\n".join(lines)


def _reproduce(args: argparse.Namespace) -> int:
    from kvcake.sim.reproduce import run_experiment

    base = SimConfig(speed=args.speed, max_requests=args.max_requests, profile=args.profile,
                     seed=args.seed, ttft_slo_s=args.ttft_slo_s, tbt_slo_ms=args.tbt_slo_ms,
                     cpp_min_tokens=args.cpp_min_tokens, cpp_nodes=args.cpp_nodes,
                     cpp_chunk_tokens=args.cpp_chunk_tokens,
                     decode_reselect_at_handoff=args.decode_reselect_at_handoff,
                     decode_check_keeps_node=args.decode_check_keeps_node)
    report = run_experiment(args.experiment, args.trace, args.out, base)
    print(json.dumps(report.data, sort_keys=True) if args.json else report.path)
    return 0


def _trace_stats(args: argparse.Namespace) -> int:
    print(json.dumps(load_trace(args.file).stats().to_dict(), sort_keys=True))
    return 0


def _trace_gen(args: argparse.Namespace) -> int:
    from kvcake.sim.tracegen import TraceGenConfig, generate_trace

    fields: dict[str, object] = {"num_requests": args.num_requests,
                                 "rate_per_s": args.rate_per_s, "seed": args.seed}
    defaults = TraceGenConfig()
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not hasattr(defaults, key) or key in fields:
            raise SystemExit(f"kvcake trace gen: error: --set {item!r}: want KEY=VALUE with KEY a "
                             f"TraceGenConfig field other than num_requests, rate_per_s, seed")
        kind = type(getattr(defaults, key))
        try:
            fields[key] = kind(value)
        except ValueError:
            raise SystemExit(f"kvcake trace gen: error: --set {key}: {value!r} is not "
                             f"{kind.__name__}") from None
    try:
        cfg = TraceGenConfig.from_dict(fields)
    except ValueError as exc:
        raise SystemExit(f"kvcake trace gen: error: {exc}") from None
    generate_trace(cfg).write(args.out)
    print(args.out)
    return 0
