r"""The live side of the simulator check over N replays of the same run (issue 11 part 3).

One live replay is 40 requests: its TTFT p90 is the 4th-largest sample, and two quiet replays of
the same requests, arrivals and code differed by 15-45% on a p90, a TBT p50 and the tightest
share (docs/benchmarks.md, the lead's quiet reruns, ninth session). So the check replays the
same requests and arrivals N times per system and rate (a fresh server each time: no replay
sees another's cache) and compares the simulator with the metric of the POOLED per-request
samples: N x 40 TTFTs, the N x 40 requests' TBTs (the paper's TBT of each request, the mean of
its slowest 10% of gaps), and the effective share over N x 40 requests. Each replay's own value
is kept: their range (min / max) and relative spread ((max - min) / pooled) are the live noise
floor, and a simulated value inside the range is as close as one more live replay would be.

DEFAULT_REPEATS = 3, chosen before any pooled result was seen: (a) 120 samples put a p90 at the
12th-largest, where one replay's is the 4th; (b) the range of 3 independent replays holds the
replays' median with probability 1 - 2 x 2^-3 = 75% (2: 50%; 5: 94%); (c) a replay lasts about
2-2.6 min with the server's start (40 / rate of arrivals plus the tail), so 3 replays of one
system at one rate fit one 15-minute lock hold with room, and 2 systems x 2 rates take ~28 min.

Arithmetic on `RequestResult`s (a replay's metrics: `live_metrics`) and metric dicts, and the
live files; the servers are the caller's (`replay_once`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcake.bench.regime import Regime
from kvcake.bench.stats import Outcome, RequestResult, effective_shares, paper_tbt_s, tpot_s

DEFAULT_REPEATS = 3
WITHIN = 0.15  # the target on |sim / live - 1|, live = the pooled value


def repeats_arg(text: str) -> int:
    """`--live-repeats`: an integer >= 1 (argparse type; its error names the option)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or str(n) != text.strip():
        raise argparse.ArgumentTypeError(
            f"--live-repeats must be a whole number of replays >= 1 (got {text!r}); "
            f"the default is {DEFAULT_REPEATS}")
    return n


def pool(replays: Sequence[Sequence[RequestResult]],
         metrics_of: Callable[[list[RequestResult]], dict[str, float]]) -> dict[str, Any]:
    """{"metrics": metrics_of(all replays' requests together), "replays": [metrics_of(one
    replay) for each]}: percentiles over the pooled samples, shares over all requests."""
    if not replays:
        raise ValueError("pool needs at least one replay")
    pooled = [r for one in replays for r in one]
    return {"metrics": metrics_of(pooled), "replays": [metrics_of(list(one)) for one in replays]}


def spread(pooled: float, values: Sequence[float]) -> dict[str, float | None]:
    """The replays' range of one metric and its relative width (max - min) / pooled (None when
    the pooled value is 0)."""
    lo, hi = min(values), max(values)
    return {"live_min": lo, "live_max": hi,
            "live_spread": (hi - lo) / abs(pooled) if pooled else None}


def annotate(metrics: dict[str, dict[str, Any]],
             replays: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """`compare`'s {"system.metric": {"live", "sim", "rel_err"}} with, where the system has
    per-replay metrics: "live_replays" (each replay's value), "live_min" / "live_max",
    "live_spread", "sim_in_live_range" (min <= sim <= max), and for every metric
    "within_target" (|rel_err| <= WITHIN against the pooled live value; None without one)."""
    out: dict[str, dict[str, Any]] = {}
    for key, m in metrics.items():
        system, name = key.split(".", 1)
        row = dict(m)
        row["within_target"] = None if m["rel_err"] is None else abs(m["rel_err"]) <= WITHIN
        values = [r[name] for r in replays.get(system, []) if name in r]
        if values:
            row["live_replays"] = values
            row |= spread(m["live"], values)
            row["sim_in_live_range"] = row["live_min"] <= m["sim"] <= row["live_max"]
        out[key] = row
    return out


def noise_floor(metrics: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per metric, the live replays' own relative spread (the closest any model can be shown
    to be from these replays)."""
    return {k: m.get("live_spread") for k, m in metrics.items() if "live_replays" in m}


def stamp() -> dict[str, Any]:
    return {"at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load": list(os.getloadavg())}


@dataclass(frozen=True)
class ReplayFile:
    """What `replay_file` replays into: the live file `path` of `rate`; with `replay`, each
    of `systems` replayed `repeats` times; `append`: pooled with the replays the file holds."""

    path: Path
    rate: float
    systems: tuple[str, ...]
    repeats: int
    replay: bool = True
    append: bool = False


def replay_file(target: ReplayFile, replay_once: Callable[[str], list[RequestResult]],
                metrics_of: Callable[[list[RequestResult]], dict[str, float]],
                when: Callable[[], dict[str, Any]] = stamp,
                extras: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The live metrics at the target's `rate` ({"metrics": pooled, "replays": each replay's},
    per system). With its `replay`, each of its `systems` is replayed `repeats` times
    (`replay_once(system)`: one replay on a fresh server) and pooled; the other systems' come
    from its `path`, an earlier run's file, if it is of the same rate (else it is not reused).
    `path` is written after each system with every replay's per-request records (`requests`)
    and `runs` (`when()` before and after each replay, and `extras()`'s after it as "env": what
    the replay ran on).
    `append`: this call's replays of a system are pooled with those `path` already holds for it
    (an earlier invocation's, same rate): N replays split across separate invocations and lock
    holds, so a speed that differs between invocations is in the pooled value, not beside it."""
    path, rate, repeats = target.path, target.rate, target.repeats
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old and not math.isclose(float(old.get("rate", rate)), rate, rel_tol=1e-9):
        print(f"[live] {path} is of rate {old['rate']}, not {rate:.6g}: not reused",
              file=sys.stderr)
        old = {}
    got: dict[str, dict[str, float]] = dict(old.get("metrics", {}))
    reps: dict[str, list[dict[str, float]]] = dict(old.get("replays", {}))
    runs, requests = dict(old.get("runs", {})), dict(old.get("requests", {}))
    if not target.replay:
        return {"metrics": got, "replays": reps, "runs": runs}
    for system in target.systems:
        results: list[list[RequestResult]] = []
        if target.append and requests.get(system):
            results = [[from_json(r) for r in one] for one in requests[system]]
            runs[system] = list(runs.get(system, []))
        else:
            runs[system] = []
        earlier = len(results)
        for k in range(repeats):
            before = when()
            results.append(replay_once(system))
            runs[system].append({"before": before, "after": when()})
            if extras is not None:
                runs[system][-1]["env"] = extras()
            print(f"[live {system} @ {rate:.3g}/s, replay {earlier + k + 1}/{earlier + repeats}] "
                  f"{json.dumps(metrics_of(results[-1]))}", file=sys.stderr, flush=True)
        pooled = pool(results, metrics_of)
        got[system], reps[system] = pooled["metrics"], pooled["replays"]
        requests[system] = [[to_json(r) for r in one] for one in results]
        print(f"[live {system} @ {rate:.3g}/s, pooled over {len(results)}] "
              f"{json.dumps(got[system])}", file=sys.stderr, flush=True)
        path.write_text(json.dumps({"rate": rate, "repeats": max(len(r) for r in
                                                                 requests.values()),
                                    "runs": runs,
                                    "metrics": got, "replays": reps, "requests": requests})
                        + "\n")
    return {"metrics": got, "replays": reps, "runs": runs}


def ran_with(live: dict[str, Any] | None, systems: Sequence[str], key: str,
             default: Any) -> set[Any]:
    """The values of `key` that the replays of `systems` in `live` (replay_file's answer)
    recorded in their "env"; a replay recorded before the key existed ran with `default`."""
    if live is None:
        return set()
    return {run.get("env", {}).get(key, default)
            for system in systems for run in live.get("runs", {}).get(system, [])}


def check_admission(live: dict[str, Any] | None, admission: str) -> None:
    """Exit when a disaggregated replay in `live` (replay_file's answer) ran with another
    admission than `admission`, the one the simulator is about to run: the two would not be the
    same system. A replay that did not record one ran before the flag existed: none."""
    ran = ran_with(live, ("disagg",), "admission", "none")
    if len(ran) > 1:
        raise SystemExit(f"the live disaggregated replays ran with admissions "
                         f"{' and '.join(sorted(ran))}, mixed in one file: replay them again")
    if ran - {admission}:
        raise SystemExit(f"the live disaggregated replays ran with admission {ran.pop()}, not "
                         f"{admission}: pass --disagg-admission to match, or replay them again")


def check_speed_weight(live: dict[str, Any] | None, weight: float) -> None:
    """Exit when a replay in `live`, of either system, ran its Conductor with another
    `prefill_speed_weight` than `weight`, the one the simulator is about to run. A replay that
    did not record one ran before the flag existed: 0, the fitted predictions."""
    ran = ran_with(live, ("disagg", "colocated"), "prefill_speed_weight", 0.0)
    if ran - {weight}:
        weights = " and ".join(f"{w:g}" for w in sorted(ran))
        raise SystemExit(f"the live replays ran with prefill_speed_weight {weights}, not "
                         f"{weight:g}: pass --prefill-speed-weight to match, or replay them "
                         "again")


def check_files(rate: float, fit_rate: float | None, replay_rates: str,
                live_at: Callable[[float, str, bool], dict[str, Any]],
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The check rate's live file (`live.json`) and the fit / second rate's (`live_fit.json`,
    None without one), each replayed when `replay_rates` ("both", "rate", "fit-rate") names
    it; a fit rate equal to the rate is the same replays, not replayed again."""
    live = live_at(rate, "live.json", replay_rates in ("both", "rate"))
    if fit_rate is None:
        return live, None
    if math.isclose(fit_rate, rate, rel_tol=1e-9):
        return live, live
    return live, live_at(fit_rate, "live_fit.json", replay_rates in ("both", "fit-rate"))


def to_json(result: RequestResult) -> dict[str, Any]:
    return {"outcome": result.outcome.value, "prompt_len": result.prompt_len,
            "output_len": result.output_len, "ttft_s": result.ttft_s,
            "gaps_s": list(result.gaps_s), "latency_s": result.latency_s, "error": result.error}


def from_json(data: dict[str, Any]) -> RequestResult:
    return RequestResult(Outcome(data["outcome"]), int(data["prompt_len"]),
                         int(data["output_len"]), data["ttft_s"], tuple(data["gaps_s"]),
                         data["latency_s"], data.get("error", ""))


def live_metrics(results: list[RequestResult], regime: Regime) -> dict[str, float]:
    """One replay's (or the pooled replays') metrics: TTFT and TBT percentiles over the requests
    that got a first token, the mean TPOT, and the effective share of all sent requests at each
    TBT SLO (`effective_shares`, as the capacity search counts them)."""
    done = [r for r in results if r.ttft_s is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tbts = [paper_tbt_s(r.gaps_s) for r in done if r.gaps_s]
    out = {"ttft_p50_ms": 1000 * float(np.percentile(ttfts, 50)),
           "ttft_p90_ms": 1000 * float(np.percentile(ttfts, 90)),
           "tbt_p50_ms": 1000 * float(np.percentile(tbts, 50)),
           "tbt_p90_ms": 1000 * float(np.percentile(tbts, 90))}
    tpots = [t for r in done if (t := tpot_s(r)) is not None]
    if tpots:  # the mean decode step a request saw (its gaps' mean): what sets the batch
        out["tpot_mean_ms"] = 1000 * float(np.mean(tpots))
    shares = effective_shares(results, regime.ttft_slo_s, [x / 1000.0 for x in regime.tbt_slos_ms])
    for k, share in enumerate(shares):
        out[f"effective_share_slo{k + 1}"] = share
    return out


def compare(live: dict[str, dict[str, float]],
            sim: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for system, metrics in live.items():
        for name, x in metrics.items():
            y = sim[system][name]
            out[f"{system}.{name}"] = {"live": x, "sim": y,
                                       "rel_err": None if not x else (y - x) / x}
    return out


def print_table(title: str, metrics: dict[str, dict[str, Any]]) -> None:
    """live is the pooled value; with several replays also their range, relative spread (the
    live noise floor) and whether the simulated value lies inside the range."""
    print(f"{title}\n| metric | live (pooled) | sim | sim/live - 1 | live replays (min-max) "
          "| replays' spread | sim in range |\n|---|---|---|---|---|---|---|")
    for name, m in metrics.items():
        err = "-" if m["rel_err"] is None else f"{m['rel_err']:+.1%}"
        span = spread = inside = "-"
        if "live_replays" in m:
            span = f"{m['live_min']:.4g}-{m['live_max']:.4g} ({len(m['live_replays'])})"
            spread = "-" if m["live_spread"] is None else f"{m['live_spread']:.1%}"
            inside = "yes" if m["sim_in_live_range"] else "no"
        print(f"| {name} | {m['live']:.4g} | {m['sim']:.4g} | {err} | {span} | {spread} "
              f"| {inside} |")
