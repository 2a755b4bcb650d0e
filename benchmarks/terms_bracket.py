"""A bracketed check of the simulator against the live cluster (issue 11 part 3).

`sim_vs_live.py --terms-after DIR` prices the replays with a bracket: the mean
(kvcake/sim/profile_mean.py) of the live profile measured just before them (--out-dir's refits, --host-terms,
--colocated-terms) and the one measured the same way just after them (`--refit-into DIR` and
`decode_gaps.py --save DIR/gaps`). This VM's speed drifts by 9-14% within 20 minutes (the
fifteenth session's two checks of the same replays), so a profile from one end prices the
other end's host; the bracket is the host over the replays' own stretch. `bracket_ends` in the
JSON has the check with each end alone. The protocol of a bracketed check (fixed 2026-12-07
before its first run):

    D=/tmp/kvcake-capacity-s16   # regime.json, profile.json, colocated-budget.json as before
    V=".venv/bin/python"; G="benchmarks/decode_gaps.py --out-dir $D --rate 0.593 --num-requests 40 --pin on"
    $V benchmarks/sim_vs_live.py --out-dir $D --refit-decode --refit-prefill
    $V $G --systems disagg,colocated --decode-fit $D/decode_refit.json --save $D/gaps
    for R in 1 2 3; do for S in disagg colocated; do $V benchmarks/sim_vs_live.py --out-dir $D \
      --systems $S --replay-rates rate --live-repeats 1 --append-replays --live-only; done; done
    for R in 1 2; do for S in disagg colocated; do $V benchmarks/sim_vs_live.py --out-dir $D \
      --systems $S --fit-rate 0.593 --replay-rates fit-rate --live-repeats 1 --append-replays \
      --live-only; done; done
    $V benchmarks/sim_vs_live.py --out-dir $D --refit-decode --refit-prefill --refit-into $D/after
    $V $G --systems disagg,colocated --decode-fit $D/after/decode_refit.json --save $D/after/gaps
    $V benchmarks/sim_vs_live.py --out-dir $D --host-terms $D/gaps-disagg-pinon.json \
      --colocated-terms $D/gaps-colocated-pinon.json --terms-after $D/after --fit-rate 0.593 \
      --sim-only --json

Its first run (2026-12-07, 05:00-05:19; docs/benchmarks.md, sixteenth session): the bracket 23
of 32 metrics within 15%, the before-profile alone 27, the after-profile alone 17. The host's
speed over the replays was not between its ends: four identical replays of the same 40
requests at 0.593 req/s in those 19 minutes (the two terms runs and the two check replays) had
disaggregated TBT p50s of 11.5, 13.0, 12.6 and 9.9 ms. The bracket is kept as a measurement
of that drift (each end's check side by side), not as a fix for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import live_replays  # noqa: E402
from check_setup import Setup, Terms  # noqa: E402
from live_profile_fit import live_profile  # noqa: E402
from live_replays import compare  # noqa: E402
from simulated_runs import sim_metrics  # noqa: E402

from kvcake.sim.config import SimConfig  # noqa: E402


def bracketed(args: argparse.Namespace, terms: Terms, config_json: dict[str, Any],
              bandwidth: float) -> tuple[Terms, dict[str, Terms]]:
    """The terms the check prices with, and each end's ({} without --terms-after): `terms`
    (measured before the replays) alone, or its mean with the ones measured after them."""
    if args.terms_after is None:
        return terms, {}
    after = after_terms(args, config_json, bandwidth)
    return Terms.bracketed(terms, after), {"before": terms, "after": after}


def after_terms(args: argparse.Namespace, config_json: dict[str, Any],
                bandwidth: float) -> Terms:
    """--terms-after DIR: the live profile measured after the replays (DIR's refits and step
    traces)."""
    after = argparse.Namespace(**vars(args))
    for name in ("host_terms", "colocated_terms"):
        if getattr(args, name) is not None:
            setattr(after, name, args.terms_after / getattr(args, name).name)
    return Terms.measure(after, live_profile(args.out_dir, config_json, bandwidth,
                                             refits_dir=args.terms_after))


def bracket_ends(setup: Setup, ends: dict[str, Terms], configs: dict[str, SimConfig],
                 files: list[tuple[float | None, dict[str, Any] | None]]) -> dict[str, Any]:
    """--terms-after: the check with each end's profile alone, at every checked rate: its
    metrics and how many are within the target."""
    out: dict[str, Any] = {}
    for end, terms in ends.items():
        by_rate: dict[str, Any] = {}
        for rate, live in files:
            if rate is None or live is None:
                continue
            trace = setup.trace(setup.planned(rate))
            by_rate[f"{rate:.4g}"] = live_replays.annotate(compare(live["metrics"], {
                name: sim_metrics(trace, setup.regime, config, terms.cost(), terms.jitters[name])
                for name, config in configs.items() if name in live["metrics"]}),
                live["replays"])
        cells = [m for metrics in by_rate.values() for m in metrics.values()
                 if m["within_target"] is not None]
        within = sum(1 for m in cells if m["within_target"])
        print(f"the {end} profile alone: {within} of {len(cells)} metrics within "
              f"{live_replays.WITHIN:.0%} ({', '.join(by_rate)} req/s)")
        out[end] = {"within_target": within, "metrics_compared": len(cells), "by_rate": by_rate}
    return out
