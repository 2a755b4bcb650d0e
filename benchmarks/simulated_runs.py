"""The simulated side of `benchmarks/sim_vs_live.py`: the live requests as the simulator's
trace, the live systems as its configs (the disaggregated pair with the live run's admission),
one run's metrics and its share at each TBT SLO, the diagnostics printed with a check, the
simulated capacity search, and the simulator against every probe of a live capacity search
(`--check-capacity`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import host_terms  # noqa: E402
import live_profile_fit  # noqa: E402
import serving_disagg_vs_colocated as cap  # noqa: E402

from kvcake.bench.capacity import find_capacities  # noqa: E402
from kvcake.bench.prompts import PromptBuilder  # noqa: E402
from kvcake.bench.regime import Regime  # noqa: E402
from kvcake.bench.replay import PlannedRequest  # noqa: E402
from kvcake.sim.config import SimConfig  # noqa: E402
from kvcake.sim.live_profile import LiveCost  # noqa: E402
from kvcake.sim.records import is_effective  # noqa: E402
from kvcake.sim.run import simulate  # noqa: E402
from kvcake.sim.trace import Trace, TraceRequest  # noqa: E402


def sim_trace(records: list[TraceRequest], planned: list[PlannedRequest],
              block_len: int) -> Trace:
    """The planned requests as the simulator's trace: scaled lengths, the same hash ids (cut or
    padded with private ids to the scaled prompt's blocks), the same arrival times."""
    next_private = 1 + max(h for r in records for h in r.hash_ids)
    out = []
    for r, p in zip(records, planned, strict=True):
        n = len(p.prompt_token_ids)
        blocks = -(-n // block_len)
        ids = list(r.hash_ids[:blocks])
        while len(ids) < blocks:
            ids.append(next_private)
            next_private += 1
        out.append(TraceRequest(r.index, 1000.0 * p.send_at_s, n, p.max_tokens, tuple(ids)))
    return Trace(tuple(out), "sim_vs_live", block_size=block_len)


def sim_configs(regime: Regime, block_len: int, budget: int, admission: str = "none",
                prefill_speed_weight: float = 0.0) -> dict[str, SimConfig]:
    """The live systems as the simulator runs them: the disaggregated pair with the live run's
    admission (`--disagg-admission`) on the regime's TTFT SLO and loosest TBT SLO, as
    serving_disagg_vs_colocated.conductor_toml configures the live Conductor; the colocated pair
    never rejects. Both Conductors learn each prefill instance's speed with the live run's
    `prefill_speed_weight` (`--prefill-speed-weight`; 0: the fitted predictions)."""
    common = {"ttft_slo_s": regime.ttft_slo_s, "tbt_slo_ms": max(regime.tbt_slos_ms),
              "block_size": block_len, "seed": 0,
              "prefill_speed_weight": prefill_speed_weight}
    pool_tokens = live_profile_fit.KV_POOL_BYTES // 4096
    return {
        "disagg": SimConfig(num_prefill=1, num_decode=1, policy="global_cache",
                            store_tokens=pool_tokens, admission=admission,
                            **common),  # type: ignore[arg-type]
        "colocated": SimConfig(num_prefill=1, num_decode=1, policy="colocated",
                               chunked_prefill=True, chunk_budget_tokens=budget,
                               max_batch_size=min(64, budget - 1), admission="none",
                               **common),  # type: ignore[arg-type]
    }


def sim_metrics(trace: Trace, regime: Regime, config: SimConfig, cost: Any,
                jitter: list[float] | None = None) -> dict[str, float]:
    """The simulated run's metrics: one run (its admission, if any, checks the config's SLOs, as
    the live Conductor checks the loosest TBT SLO), the share at each TBT SLO from its requests;
    with `jitter` (host_terms' measured step dispersion) its TBTs and shares are taken with every
    gap multiplied by a draw from it."""
    result = simulate(config, trace, cost)
    summary = result.summary
    out = {"ttft_p50_ms": 1000 * summary["ttft_s"]["p50"],
           "ttft_p90_ms": 1000 * summary["ttft_s"]["p90"],
           "tbt_p50_ms": 1000 * summary["tbt_s"]["p50"],
           "tbt_p90_ms": 1000 * summary["tbt_s"]["p90"],
           "tpot_mean_ms": 1000 * sim_tpot_mean_s(result.states)}
    if not jitter:
        for k, share in enumerate(sim_shares(result.states, regime)):
            out[f"effective_share_slo{k + 1}"] = share
        return out
    tbts = host_terms.jittered_tbts(result.states, jitter)
    got = [t for t in tbts if t is not None]
    out["tbt_p50_ms"] = 1000 * float(np.percentile(got, 50))
    out["tbt_p90_ms"] = 1000 * float(np.percentile(got, 90))
    for k, slo in enumerate(regime.tbt_slos_ms):
        out[f"effective_share_slo{k + 1}"] = sum(
            1 for s, t in zip(result.states, tbts, strict=True)
            if s.ttft_s is not None and s.finish_s is not None
            and s.ttft_s <= regime.ttft_slo_s and (t is None or t <= slo / 1000.0)
        ) / max(1, len(result.states))
    return out


def sim_shares(states: Any, regime: Regime) -> list[float]:
    """The effective share of a simulated run's requests at each of the regime's TBT SLOs (a
    rejected request is a miss at every one)."""
    return [sum(is_effective(s, regime.ttft_slo_s, slo / 1000.0) for s in states)
            / max(1, len(states)) for slo in regime.tbt_slos_ms]


def sim_tpot_mean_s(states: Any) -> float:
    """Mean over requests with >= 2 output tokens of (finish - first token) / (output - 1): the
    live replay's `tpot_s`, from the simulated requests."""
    tpots = [(s.finish_s - s.first_token_s) / (s.arrival.output_len - 1) for s in states
             if s.arrival.output_len > 1 and s.finish_s is not None
             and s.first_token_s is not None]
    return float(np.mean(tpots)) if tpots else 0.0


def diagnostics(trace: Trace, config: SimConfig, cost: Any, step: float = 1.1) -> dict[str, float]:
    """What the simulated run says about itself: its prefix/store hit share (prompt tokens
    reused; the live cluster's counters say the same as `prefix_cache_hits_total /
    prefix_cache_queries_total`), its mean TPOT, and the elasticity of its TBT p50 to the decode
    step cost, d ln TBT / d ln step (decode steps `step` times slower): ~1 where the batch does not
    grow with the step, well above 1 near the decode worker's saturation, where the batch grows
    with the step and the check cannot be closer than the step model (and the live run) allow."""
    base = simulate(config, trace, cost)
    out = {"hit_share": base.summary["cache_hit_rate"],
           "tpot_mean_ms": 1000 * sim_tpot_mean_s(base.states)}
    if isinstance(cost, LiveCost):
        slower = dataclasses.replace(cost, decode_contention=cost.decode_contention * step)
        if cost.colocated is not None:  # a colocated run's decode steps: its own terms
            terms = cost.colocated
            slower = dataclasses.replace(slower, colocated=dataclasses.replace(
                terms, decode=terms.decode * step,
                decode_other_busy=terms.decode_other_busy * step))
        tbt = base.summary["tbt_s"]["p50"]
        tbt_slow = simulate(config, trace, slower.as_cost_model()).summary["tbt_s"]["p50"]
        if tbt > 0 and tbt_slow > 0:
            out["tbt_p50_elasticity"] = math.log(tbt_slow / tbt) / math.log(step)
    return out


def sim_capacity(records: list[TraceRequest], regime: Regime, cost: Any,
                 configs: dict[str, SimConfig], vocab_size: int) -> dict[str, list[float | None]]:
    """The simulator's capacity per TBT SLO for the same regime, each of `configs` (sim_configs'
    systems): the capacity benchmark's search (start rate, probes, 90% target) over the same
    requests, each probe one simulated run."""
    block_len = PromptBuilder(scale_tokens=regime.scale_tokens).block_len
    out: dict[str, list[float | None]] = {}
    for name, config in configs.items():
        def probe(rate: float, config: SimConfig = config) -> list[float]:
            planned = cap.workload(records, regime, vocab_size, rate, seed=0)
            return sim_shares(simulate(config, sim_trace(records, planned, block_len),
                                       cost).states, regime)

        found = find_capacities(probe, 0.5 / regime.mean_prefill_s, len(regime.tbt_slos_ms),
                                cap.TARGET_SHARE, regime.max_probes)
        out[name] = list(found.best_speeds)
    return out


PROBE_KEYS = {"ttft_p50_ms": "median_ttft_ms", "ttft_p90_ms": "p90_ttft_ms",  # ours: the probe's
              "tbt_p50_ms": "median_tbt_ms", "tbt_p90_ms": "p90_tbt_ms",
              "tpot_mean_ms": "mean_tpot_ms"}


def capacity_check(cap_dir: Path, regime: Regime, records: list[TraceRequest], cost: Any,
                   budget: int, vocab_size: int) -> dict[str, Any]:
    """The simulator against every probe of a live capacity search (`serving_disagg_vs_colocated.py`
    in `cap_dir`, the same regime: the same requests and arrival offsets, one rate per probe), with
    the profile fitted here: more live points than the one check rate, each one 40-request run.
    Per system: rows {rate, prefill_busy_share (simulated prefill compute / makespan; colocated:
    both workers' chunks), implied_decode_factor (where the probe has a mean TPOT: the decode
    factor that makes the simulated mean TPOT the live one), metric: {live, sim, rel_err}}, and
    the prompt-token hit share of the live search (its counters, all probes) against the
    simulated runs' mean."""
    other = Regime.from_json((cap_dir / "regime.json").read_text())
    if other != regime:
        raise SystemExit(f"{cap_dir}/regime.json is not this out-dir's regime: the probes would "
                         "not be the same requests")
    block_len = PromptBuilder(scale_tokens=regime.scale_tokens).block_len
    out: dict[str, Any] = {}
    for system in ("disagg", "colocated"):
        path = cap_dir / f"{system}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        config = sim_configs(regime, block_len, int(data.get("chunk_budget") or budget),
                             data.get("admission", "none"),
                             data.get("prefill_speed_weight", 0.0))[system]  # as probes ran
        rows, hits = [], []
        for probe in sorted(data["probes"], key=lambda p: p["rate"]):
            planned = cap.workload(records, regime, vocab_size, probe["rate"], seed=0)
            result = simulate(config, sim_trace(records, planned, block_len), cost)
            summary = result.summary
            hits.append(summary["cache_hit_rate"])
            sim = {"ttft_p50_ms": 1000 * summary["ttft_s"]["p50"],
                   "ttft_p90_ms": 1000 * summary["ttft_s"]["p90"],
                   "tbt_p50_ms": 1000 * summary["tbt_s"]["p50"],
                   "tbt_p90_ms": 1000 * summary["tbt_s"]["p90"],
                   "tpot_mean_ms": 1000 * sim_tpot_mean_s(result.states)}
            row: dict[str, Any] = {"rate": probe["rate"],
                                   "prefill_busy_share": summary["prefill_compute_s"]
                                   / max(1e-9, summary["makespan_s"])}
            if probe.get("mean_tpot_ms") and isinstance(cost, LiveCost):
                row["implied_decode_factor"] = implied_decode_factor(
                    float(probe["mean_tpot_ms"]), config, sim_trace(records, planned, block_len),
                    cost)
            for name, key in PROBE_KEYS.items():
                if probe.get(key) is not None:
                    x = float(probe[key])
                    row[name] = {"live": x, "sim": sim[name],
                                 "rel_err": (sim[name] - x) / x if x else None}
            rows.append(row)
        counters = data.get("counters", {})
        queries = counters.get("prefix_cache_queries_total")
        out[system] = {"probes": rows, "hit_share": {
            "live": counters["prefix_cache_hits_total"] / queries if queries else None,
            "sim": float(np.mean(hits)) if hits else None}}
    return out


def implied_decode_factor(tpot_ms: float, config: SimConfig, trace: Trace,
                          cost: LiveCost) -> float:
    """The decode contention factor (every other term of `cost` held) at which the simulated
    mean TPOT equals the live one: the mean slowdown of the live decode steps against the
    isolated step fit, as this run's requests saw it (bounds 0.5 / 8 where outside)."""
    def measure(f: float) -> float:
        slower = dataclasses.replace(cost, decode_contention=f).as_cost_model()
        return 1000 * sim_tpot_mean_s(simulate(config, trace, slower).states)
    return live_profile_fit.fit_factor(tpot_ms, measure)


def print_capacity_check(check: dict[str, Any]) -> None:
    names = list(PROBE_KEYS)
    for system, data in check.items():
        print(f"{system}: live / sim (error) per probe of the capacity search; prompt-token hit "
              f"share live {data['hit_share']['live']} sim {data['hit_share']['sim']}")
        print("| rate | " + " | ".join(names) + " | prefill busy | implied decode factor |\n"
              "|---|" + "---|" * (len(names) + 2))
        for row in data["probes"]:
            cells = []
            for name in names:
                m = row.get(name)
                cells.append("-" if m is None else
                             f"{m['live']:.4g} / {m['sim']:.4g} ({m['rel_err']:+.0%})")
            implied = row.get("implied_decode_factor")
            cells += [f"{row['prefill_busy_share']:.2f}",
                      "-" if implied is None else f"{implied:.3f}"]
            print(f"| {row['rate']:.3f} | " + " | ".join(cells) + " |")
