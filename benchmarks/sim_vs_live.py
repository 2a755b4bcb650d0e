r"""The simulator against the live cluster: the same scaled trace, the same topology (issue 11 part 3).

    B=benchmarks/serving_disagg_vs_colocated.py; D=/tmp/kvcake-capacity
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --measure-regime   # once
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --systems colocated-budget
    flock /tmp/kvcake_bench.lock .venv/bin/python benchmarks/sim_vs_live.py --out-dir $D --refit-decode
    flock /tmp/kvcake_bench.lock .venv/bin/python benchmarks/sim_vs_live.py --out-dir $D \
        --fit-rate 0.394 --json

`--refit-decode` measures the decode step model again over the batches and contexts the live
decode worker runs at (`decode_refit.json`, used instead of `profile.json`'s decode fit);
`--refit-prefill` the prefill regression over `profile.json`'s grid (`prefill_refit.json`): the
live profile then prices the current engine while the regime (profile.json's s_d) stays fixed.
`--terms-after DIR` prices the replays with the mean of the live profile measured just before
and just after them, and checks each end alone too (benchmarks/terms_bracket.py: why, and the
protocol of a bracketed check).
`--check-capacity DIR` also compares the simulator, with the profile fitted here, against every
probe of a live capacity search of the same regime (`serving_disagg_vs_colocated.py`'s out-dir:
the same requests and arrival offsets, one rate per probe, each colocated probe at that search's
chunk budget): TTFT p50/p90, TBT p50/p90 and mean TPOT per rate, and the prompt-token hit share
(the live counters against the simulated runs); `--no-capacity` skips the simulated capacity
search. Printed with the check: the simulated runs' hit share, mean TPOT and the elasticity of
their TBT p50 to the decode step cost (`diagnostics`).
`--host-terms SAVED` instead measures the live profile's host terms from a live step trace
(`decode_gaps.py --save`; benchmarks/host_terms.py: the decode worker's per-step overhead, the
decode steps' wall over the isolated fit with the prefill worker idle and computing, the prefill
factor): nothing is fitted to a compared metric, and a `--fit-rate` replay is then a second check
rate. `--batch-series SAVED` (with `--sim-only`) prints the saved run's decode batch, step and
prefill busy share over time next to the simulated ones, and the metrics of that run.
`--colocated-terms SAVED` measures the colocated side's terms from a colocated step trace
(`decode_gaps.py --systems colocated --save`; benchmarks/colocated_terms.py: decode and chunk
factors over the isolated fits with the other colocated worker idle / stepping, the per-step
overhead, the steps' dispersion), the live profile's `colocated` section
(kvcake/sim/colocated_cost.py); with `--colocated-by-rows` also the decode and mixed-chunk
factors per decode-row bucket (1, 2, 3, 4+ rows; fewer than 100 steps in a bucket: the pooled
factor), the section's `by_rows` table; `--colocated-series SAVED` (with `--sim-only`) prints the saved
colocated run's steps by kind, requests per worker and batch over time next to the simulated
ones, and that run's metrics.
`--fit-rate R` also replays at rate R (`live_fit.json`) and fits the per-host contention factors
of the live profile (kvcake/sim/live_profile.py: decode steps and prefills take f times the
isolated fit on a shared host) so the simulated disaggregated TTFT p50 and TBT p50 at R match
the live ones; the comparison at --rate then checks the model at another rate.

Inputs, all written by `serving_disagg_vs_colocated.py` into --out-dir before this runs:
`regime.json` (the scaled requests, SLOs), `profile.json` (`kvcake profile`'s fits measured on one
1-thread engine of the 44M Llama: prefill regression, decode step model) and
`colocated-budget.json` (the colocated workers' prefill-chunk budget). The live profile handed to
the simulator (`kvcake simulate --live-profile`, kvcake/sim/live_profile.py) is that profile plus
the measured transfer bandwidth (`transport.json`'s after-prefill shared-memory hand-off: bytes
/ exposed seconds, when present; else a measured 64 MiB memcpy, which is what a same-host hand-off
is), the workers' KV pool (1 GiB) and the model's shape.

Live: the regime's requests (first 40 conversation-trace records, scaled; seeded Poisson arrivals
at --rate, default the capacity search's start rate 0.5 / mean prefill) replayed --live-repeats
times (default 3, fixed before any pooled result: benchmarks/live_replays.py says why) against
1P+1D (global_cache, store) and as many times against 2 colocated workers, a fresh server for
each replay, the same requests and arrival times each time. Simulated: the same requests
(scaled prompt and block lengths, the same hash ids, the same arrival times and output lengths) on
`kvcake simulate`'s cluster of the same shape (1 prefill + 1 decode node with a store tier; 2
colocated nodes with chunked prefill at the same budget and a prefix cache; it never rejects).
`--disagg-admission` and `--prefill-speed-weight` (serving_disagg_vs_colocated.py's flags) run
the live Conductors and the simulated ones alike; each live replay records both, and the check
refuses live files replayed with others (a file from before a flag ran with its default).
Compared: TTFT p50/p90, TBT p50/p90 (the paper's TBT: mean of a request's slowest 10% of gaps;
requests with at least one gap), the mean TPOT (when the live file has it: the mean decode step a
request saw) and the effective share at each TBT SLO. `--json` prints
{"metrics": {name: {"live": x, "sim": y, "rel_err": (y - x) / x, ...}}}, where "live" is the
metric over the POOLED requests of the N replays (percentiles of N x 40 TTFTs and of N x 40
requests' TBTs, shares over N x 40 requests), and, with per-replay results, "live_replays" (each
replay's value), "live_min" / "live_max", "live_spread" ((max - min) / live) and
"sim_in_live_range"; "within_target" is |rel_err| <= 0.15 for every metric. The object also
has "live_repeats" (per system), "live_noise_floor" (each metric's live_spread) and
"placements" (benchmarks/placement_check.py: per rate and system, how many of each replay's
requests the live Conductor and the simulated one placed alike, and the ones they did not; from
replays recorded since the placement trace, 2026-12-07).

What "within 15%" means: |sim / pooled live - 1| <= 0.15. One 40-request replay cannot pin a
model to 15% (two quiet replays of the same run differed by 15-45% on a TTFT p90, a TBT p50 and
the tightest share); the replays' own spread is the live noise floor: where a metric's
live_spread is above 15%, a miss of the pooled value by less than the spread is not evidence
against the model, and "sim_in_live_range" says whether the simulated value is as close as a
further live replay would be. The simulated side is one deterministic run at the replays'
arrivals (like with like: the live replays share those arrivals).

`--replay-rates rate|fit-rate` replays only that rate's file (the other's is reused), and
`--systems` only those systems, so N replays of 2 systems at 2 rates can be split into lock
holds of at most 15 minutes; a --fit-rate equal to --rate uses the same replays (not replayed
again). The live files (`live.json`, `live_fit.json`) keep each replay's per-request records
(`requests`), so the pooling can be recomputed without replaying.

Each replay's run entry also has "env" (benchmarks/replay_env.py): the workers' torch threads,
OS threads, affinity and where their threads ran, their run-queue wait, whether pin_workers was
on (`--pin`, default on), the GEMM tuning tables (hash; measured at start-up or loaded), the
machine's /proc/stat shares (steal, idle) and load over the replay, CPU MHz, and the decode
worker's step times from its step trace (step wall / CPU, the gap time outside the step);
`benchmarks/invocation_spread.py` sets separate invocations' replays side by side.
`--append-replays` pools an invocation's replays with those its live file already holds (same
rate): `--live-repeats 1 --append-replays` per invocation, invocations of the two systems
alternating, spreads each system's N replays over separate invocations and lock holds, so a
speed that differs between invocations lands in the pooled value (docs/benchmarks.md, eleventh
session). `--live-only` replays and stops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import colocated_terms  # noqa: E402
import host_terms  # noqa: E402
import live_replays  # noqa: E402
import placement_check  # noqa: E402
import terms_bracket  # noqa: E402
from check_setup import Setup, Terms  # noqa: E402
from live_profile_fit import (  # noqa: E402
    fit_contention,
    live_profile,
    refit,
    transfer_bandwidth,
)
from live_replays import compare, live_metrics, print_table  # noqa: E402
from simulated_runs import (  # noqa: E402
    capacity_check,
    diagnostics,
    print_capacity_check,
    sim_capacity,
    sim_configs,
    sim_metrics,
)

from kvcake.sim.config import SimConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _check_flags(p)
    _live_flags(p)
    args = p.parse_args(argv)
    if args.live_only and args.sim_only:
        p.error("--live-only and --sim-only exclude each other: pass one")
    if args.append_replays and args.sim_only:
        p.error("--append-replays adds replays; --sim-only replays nothing: pass one")
    if args.terms_after is not None:
        missing = [str(args.terms_after / path.name) for path in
                   (args.host_terms, args.colocated_terms)
                   if path is not None and not (args.terms_after / path.name).is_file()]
        if missing:
            p.error(f"--terms-after: {', '.join(missing)} not found (save the step traces "
                    "measured after the replays there under the same names)")
    if args.colocated_by_rows and args.colocated_terms is None:
        p.error("--colocated-by-rows needs --colocated-terms SAVED (the step trace it measures)")
    return args


def _check_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/kvcake-capacity"))
    p.add_argument("--rate", type=float, default=None,
                   help="requests per second (default: 0.5 / the regime's mean prefill)")
    p.add_argument("--seed", type=int, default=7, help="prompt tokens of the replay")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sim-only", action="store_true",
                   help="reuse live.json from an earlier run (only the simulator runs)")
    p.add_argument("--refit-decode", action="store_true",
                   help="measure the decode step model again (decode_refit.json), then stop")
    p.add_argument("--refit-prefill", action="store_true",
                   help="measure the prefill regression again (prefill_refit.json), then stop")
    p.add_argument("--refit-into", type=Path, default=None, metavar="DIR",
                   help="write --refit-decode / --refit-prefill there (default --out-dir): "
                        "the fits of a run's end, for --terms-after DIR")
    p.add_argument("--terms-after", type=Path, default=None, metavar="DIR",
                   help="price the replays with the mean of the live profile measured before "
                        "them (--out-dir's refits, --host-terms, --colocated-terms) and the "
                        "one measured after them (DIR's refits, and DIR's saved step traces of "
                        "the same file names); each end alone is also checked")
    p.add_argument("--fit-rate", type=float, default=None,
                   help="also replay at this rate (live_fit.json) and fit the per-host "
                        "contention factors to its disaggregated TTFT/TBT p50; the comparison "
                        "at --rate is then the check")
    p.add_argument("--check-capacity", type=Path, default=None, metavar="DIR",
                   help="also compare the simulator with every probe of the live capacity "
                        "search in DIR (serving_disagg_vs_colocated.py's out-dir, same regime)")
    p.add_argument("--host-terms", type=Path, default=None, metavar="SAVED",
                   help="the live profile's host terms measured from a decode_gaps.py --save "
                        "file (benchmarks/host_terms.py: per-step overhead, decode factor with "
                        "the prefill worker idle / computing, prefill factor); nothing fitted")
    p.add_argument("--batch-series", type=Path, default=None, metavar="SAVED",
                   help="the live decode batch, step and prefill busy share over time in a "
                        "decode_gaps.py --save file next to the simulated ones (its rate and "
                        "requests), then stop")
    p.add_argument("--colocated-terms", type=Path, default=None, metavar="SAVED",
                   help="the live profile's colocated step terms measured from a decode_gaps.py "
                        "--systems colocated --save file (benchmarks/colocated_terms.py: decode "
                        "and chunk factors with the other worker idle / stepping, per-step "
                        "overhead, step dispersion); nothing fitted")
    p.add_argument("--colocated-by-rows", action="store_true",
                   help="with --colocated-terms: also measure the decode and mixed-chunk factors "
                        "per decode-row bucket (1, 2, 3, 4+; a bucket under "
                        f"{colocated_terms.MIN_BUCKET_STEPS} steps keeps the pooled factor) and "
                        "price steps with them")
    p.add_argument("--colocated-series", type=Path, default=None, metavar="SAVED",
                   help="the saved colocated run's steps by kind (decode / mixed / chunk), "
                        "requests per worker and batch over time next to the simulated ones, "
                        "and that run's metrics, then stop")


def _live_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-capacity", action="store_true",
                   help="skip the simulated capacity search (sim_capacity.json)")
    p.add_argument("--systems", default="disagg,colocated",
                   help="live systems to replay (the others' live results are reused)")
    p.add_argument("--live-repeats", type=live_replays.repeats_arg,
                   default=live_replays.DEFAULT_REPEATS, metavar="N",
                   help="replays of the same requests and arrivals per system and rate, each on a "
                        "fresh server; the live metrics are over the pooled requests (default "
                        f"{live_replays.DEFAULT_REPEATS}: benchmarks/live_replays.py says why)")
    p.add_argument("--replay-rates", choices=("both", "rate", "fit-rate"), default="both",
                   help="which rates' live files this run replays (the other's is reused): "
                        "splits a check into lock holds of at most 15 minutes")
    p.add_argument("--pin", choices=("on", "off"), default="on",
                   help="the live clusters' pin_workers (kvcake/server/cluster/cpu_pinning.py; "
                        "default on, the cluster's default since the eleventh session; every "
                        "earlier check ran off)")
    p.add_argument("--append-replays", action="store_true",
                   help="pool this invocation's replays with those the live file already holds "
                        "for the system (same rate): --live-repeats N split across separate "
                        "invocations and lock holds, pooled by design")
    p.add_argument("--live-only", action="store_true",
                   help="replay and write the live files, then stop (no simulator run)")
    p.add_argument("--disagg-admission", choices=("early", "slo", "none"), default="early",
                   help="the disaggregated pair's admission, live and simulated "
                        "(serving_disagg_vs_colocated.py's flag; none: the live files of "
                        "checks before 2026-12-07)")
    p.add_argument("--prefill-speed-weight", type=float, default=0.0,
                   help="both pairs' Conductor learns each prefill instance's speed with this "
                        "weight, live and simulated (serving_disagg_vs_colocated.py's flag; 0, "
                        "the default: the fitted predictions, as every check before 2026-12-08)")


def saved_run(args: argparse.Namespace, setup: Setup, terms: Terms,
              configs: dict[str, SimConfig]) -> dict[str, Any]:
    """--colocated-series / --batch-series: the saved step-trace run next to its simulation."""
    system = "colocated" if args.colocated_series is not None else "disagg"
    saved = host_terms.load_saved(args.colocated_series or args.batch_series)
    planned = setup.planned(saved["rate"], len(saved["requests"]))
    trace, cost = setup.trace(planned), terms.cost()
    if system == "colocated":
        out: dict[str, Any] = {"colocated_steps": colocated_terms.compare_steps(
            saved, trace, configs["colocated"], cost), "colocated_terms": terms.colocated}
        colocated_terms.print_compare(out["colocated_steps"])
        title = f"the saved colocated run ({saved['rate']:.3g}/s, {len(planned)} requests)"
    else:
        out = {"batch_series": host_terms.batch_series(saved, trace, configs["disagg"], cost),
               "host_terms": terms.host}
        host_terms.print_series(out["batch_series"])
        title = f"the saved run ({saved['rate']:.3g}/s, {len(planned)} requests)"
    out["metrics"] = compare({system: live_metrics(host_terms.results_of(saved), setup.regime)},
                             {system: sim_metrics(trace, setup.regime, configs[system], cost,
                                                  terms.jitters[system])})
    print_table(title, out["metrics"])
    return out


def second_rate(args: argparse.Namespace, setup: Setup, terms: Terms, fit_file: dict[str, Any],
                configs: dict[str, SimConfig],
                refit: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The --fit-rate comparison: a second check rate when host or colocated terms were
    measured (nothing fitted); otherwise the contention factors fitted to its disaggregated
    TTFT/TBT p50 (`refit(contention)` is then the live profile with them), and its metrics."""
    fit_live, fit_reps = fit_file["metrics"], fit_file["replays"]
    trace = setup.trace(setup.planned(args.fit_rate))
    contention = None
    if terms.host is None and terms.colocated is None:
        if "disagg" not in fit_live:
            return None, None
        contention = fit_contention(terms.profile, fit_live["disagg"], trace, setup.regime,
                                    configs["disagg"])
        terms.profile = refit(contention)
        print(f"contention fitted at {args.fit_rate:.3g}/s (disagg TTFT/TBT p50): "
              f"{json.dumps(contention)}")
    jitters = terms.jitters if contention is None else {}
    metrics = live_replays.annotate(compare(fit_live, {
        name: sim_metrics(trace, setup.regime, config, terms.cost(), jitters.get(name))
        for name, config in configs.items() if name in fit_live}), fit_reps)
    print_table(f"{'fit' if contention else 'second check'} rate {args.fit_rate:.3g}/s",
                metrics)
    return contention, metrics


def capacities(args: argparse.Namespace, setup: Setup, cost: Any,
               configs: dict[str, SimConfig]) -> dict[str, Any]:
    """--check-capacity: the simulator against every live capacity probe; unless
    --no-capacity, the simulated capacity search (`sim_capacity.json`)."""
    out: dict[str, Any] = {}
    regime, vocab_size = setup.regime, setup.cap_args.vocab_size
    if args.check_capacity is not None:
        out["capacity_check"] = capacity_check(args.check_capacity, regime, setup.records,
                                               cost, setup.budget, vocab_size)
        print_capacity_check(out["capacity_check"])
    if not args.no_capacity:
        capacity = sim_capacity(setup.records, regime, cost, configs, vocab_size)
        (args.out_dir / "sim_capacity.json").write_text(json.dumps(capacity) + "\n")
        print(f"simulated capacity (req/s) per TBT SLO "
              f"{[round(x, 1) for x in regime.tbt_slos_ms]}: {json.dumps(capacity)}")
    return out


def terms_out(args: argparse.Namespace, terms: Terms, contention: dict[str, float] | None,
              fit_metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The check's JSON about its terms: the contention fitted at --fit-rate, or the measured
    host terms and the second rate's metrics; the colocated terms."""
    out: dict[str, Any] = {}
    if contention is not None:
        out |= {"contention": contention, "fit_rate": args.fit_rate, "fit_metrics": fit_metrics}
    elif terms.host is not None:
        out |= {"host_terms": terms.host, "second_rate": args.fit_rate,
                "second_rate_metrics": fit_metrics}
    if terms.colocated is not None:
        out["colocated_terms"] = terms.colocated
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = Setup.load(args)
    regime, cap_args = setup.regime, setup.cap_args
    if args.refit_decode or args.refit_prefill:
        refit(args.refit_into or args.out_dir, cap_args.model_dir, args.refit_decode,
              args.refit_prefill)
        return 0
    rate = args.rate or 0.5 / regime.mean_prefill_s
    live_file, fit_file = live_replays.check_files(rate, args.fit_rate, args.replay_rates,
                                                   setup.live_at)
    if args.live_only:
        return 0
    for checked in (live_file, fit_file):
        live_replays.check_admission(checked, args.disagg_admission)
        live_replays.check_speed_weight(checked, args.prefill_speed_weight)
    config_json = json.loads((cap_args.model_dir / "config.json").read_text())
    bandwidth, source = transfer_bandwidth(args.out_dir)
    terms = Terms.measure(args, live_profile(args.out_dir, config_json, bandwidth))
    terms, ends = terms_bracket.bracketed(args, terms, config_json, bandwidth)
    configs = sim_configs(regime, setup.block_len, setup.budget, args.disagg_admission,
                          args.prefill_speed_weight)
    if args.colocated_series is not None or args.batch_series is not None:
        out = saved_run(args, setup, terms, configs)
        if args.json:
            print(json.dumps(out))
        return 0
    contention, fit_metrics = None, None
    if fit_file is not None:
        contention, fit_metrics = second_rate(
            args, setup, terms, fit_file, configs,
            lambda c: live_profile(args.out_dir, config_json, bandwidth, contention=c))
    (args.out_dir / "live_profile.json").write_text(json.dumps(terms.profile, indent=1) + "\n")
    cost, trace = terms.cost(), setup.trace(setup.planned(rate))
    live, live_reps = live_file["metrics"], live_file["replays"]
    sim = {name: sim_metrics(trace, regime, config, cost, terms.jitters[name])
           for name, config in configs.items() if name in live}
    metrics = live_replays.annotate(compare(live, sim), live_reps)
    print(f"rate {rate:.3g}/s, {len(trace.requests)} requests, block {setup.block_len} tokens, "
          f"transfer bandwidth {bandwidth / 1e9:.2f} GB/s ({source}), colocated budget "
          f"{setup.budget}")
    print_table(f"{'check ' if contention else ''}rate {rate:.3g}/s", metrics)
    diag = {name: diagnostics(trace, config, cost) for name, config in configs.items()
            if name in live}
    print(f"simulated at {rate:.3g}/s: {json.dumps(diag)}")
    out = {"metrics": metrics, "diagnostics": diag,
           "live_repeats": {s_: len(r) for s_, r in live_reps.items()},
           "live_noise_floor": live_replays.noise_floor(metrics),
           "placements": placement_check.by_rate(setup, configs, cost,
                                                 [(rate, live_file), (args.fit_rate, fit_file)])}
    print(f"placements alike, live and simulated: {json.dumps(out['placements'])}")
    if ends:
        out["bracket_ends"] = terms_bracket.bracket_ends(
            setup, ends, configs, [(rate, live_file), (args.fit_rate, fit_file)])
    out |= capacities(args, setup, cost, configs) | terms_out(args, terms, contention, fit_metrics)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
