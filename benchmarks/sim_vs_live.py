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
colocated nodes with chunked prefill at the same budget and a prefix cache), admission off.
Compared: TTFT p50/p90, TBT p50/p90 (the paper's TBT: mean of a request's slowest 10% of gaps;
requests with at least one gap), the mean TPOT (when the live file has it: the mean decode step a
request saw) and the effective share at each TBT SLO. `--json` prints
{"metrics": {name: {"live": x, "sim": y, "rel_err": (y - x) / x, ...}}}, where "live" is the
metric over the POOLED requests of the N replays (percentiles of N x 40 TTFTs and of N x 40
requests' TBTs, shares over N x 40 requests), and, with per-replay results, "live_replays" (each
replay's value), "live_min" / "live_max", "live_spread" ((max - min) / live) and
"sim_in_live_range"; "within_target" is |rel_err| <= 0.15 for every metric. The object also
has "live_repeats" (per system) and "live_noise_floor" (each metric's live_spread).

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
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import colocated_terms  # noqa: E402
import host_terms  # noqa: E402
import live_replays  # noqa: E402
import replay_env  # noqa: E402
import serving_disagg_vs_colocated as cap  # noqa: E402

from kvcake.bench.capacity import find_capacities  # noqa: E402
from kvcake.bench.prompts import PromptBuilder  # noqa: E402
from kvcake.bench.regime import Regime  # noqa: E402
from kvcake.bench.replay import PlannedRequest  # noqa: E402
from kvcake.bench.stats import RequestResult, paper_tbt_s, tpot_s  # noqa: E402
from kvcake.sim.config import SimConfig  # noqa: E402
from kvcake.sim.live_profile import LiveCost, live_cost_from_dict  # noqa: E402
from kvcake.sim.records import is_effective  # noqa: E402
from kvcake.sim.run import simulate  # noqa: E402
from kvcake.sim.trace import Trace, TraceRequest  # noqa: E402

SHAPE_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",  # ours: HF's
              "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
              "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}
KV_POOL_BYTES = 2**30  # each live worker's pool (serving_disagg_vs_colocated.KV_CACHE)


def memcpy_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def transfer_bandwidth(out_dir: Path) -> tuple[float, str]:
    path = out_dir / "transport.json"
    if path.is_file():
        shm = json.loads(path.read_text()).get("transport", {}).get("after_prefill/shm")
        if shm and shm.get("exposed_ms"):
            return shm["mib"] * 2**20 / (shm["exposed_ms"] / 1000.0), "transport.json"
    return memcpy_bandwidth(), "memcpy"


DECODE_REFIT = "decode_refit.json"


def one_thread_engine(model_dir: Path, kv_cache_bytes: int) -> Any:
    """An engine of the current code on one torch thread, as `kvcake profile` measures one."""
    import torch

    from kvcake.engine.config import EngineConfig
    from kvcake.engine.engine import Engine

    torch.set_num_threads(1)
    return Engine(str(model_dir), EngineConfig(kv_cache_bytes=kv_cache_bytes,
                                               max_model_len=cap.MAX_MODEL_LEN))


def refit_decode(out_dir: Path, model_dir: Path) -> dict[str, Any]:
    """Decode steps measured again on one 1-thread engine over the batches and contexts the live
    decode worker runs at (batch 1..24, 512 or 2,048 tokens each; best of 3): `profile.json`'s
    decode points were measured before the profiler timed whole batches (its early requests
    had finished by the timed steps: the points' batches were smaller than labelled, and the
    fit had a ~0 batch term and a negative context term)."""
    from kvcake.conductor import DecodeStepPredictor
    from kvcake.server.cluster.profiler import ProfileGrid, measure_decode

    engine = one_thread_engine(model_dir, KV_POOL_BYTES)
    grid = ProfileGrid(decode_batch_sizes=(1, 4, 8, 16, 24), decode_context_lens=(512, 2048),
                       repeats=3)
    points = measure_decode(engine, grid)
    fit = DecodeStepPredictor.fit(points)
    data = {"decode": json.loads(fit.to_json()),
            "decode_points": [[p.batch_size, p.context_tokens, p.time_s] for p in points]}
    (out_dir / DECODE_REFIT).write_text(json.dumps(data, indent=1) + "\n")
    return data


PREFILL_REFIT = "prefill_refit.json"


def refit_prefill(out_dir: Path, model_dir: Path) -> dict[str, Any]:
    """The prefill regression measured again on one 1-thread engine of the current code, over
    the grid `serving_disagg_vs_colocated.py --measure-regime` used for `profile.json` (256 to
    8,192 tokens, 0 / 50 / 90% cached; best of 2): the regime stays fixed, only the simulator's
    price of a prefill follows the engine (`prefill_refit.json`, used instead of
    `profile.json`'s prefill fit)."""
    from kvcake.conductor import PrefillTimePredictor
    from kvcake.server.cluster.profiler import ProfileGrid, measure_prefill

    engine = one_thread_engine(model_dir, 2 * KV_POOL_BYTES)
    grid = ProfileGrid(input_lens=(256, 1024, 2048, 4096, 8192), prefix_fracs=(0.0, 0.5, 0.9),
                       repeats=2)
    points = measure_prefill(engine, grid)
    fit = PrefillTimePredictor.fit(points)
    data = {"prefill": json.loads(fit.to_json()),
            "prefill_points": [[p.input_len, p.prefix_len, p.time_s] for p in points]}
    (out_dir / PREFILL_REFIT).write_text(json.dumps(data, indent=1) + "\n")
    return data


def live_profile(out_dir: Path, model_config: dict[str, Any], bandwidth: float,
                 dtype_bytes: int = 4, contention: dict[str, float] | None = None,
                 ) -> dict[str, Any]:
    """`profile.json` + the `live` object kvcake/sim/live_profile.py reads; the decode model
    from `decode_refit.json` when --refit-decode wrote one."""
    data: dict[str, Any] = json.loads((out_dir / "profile.json").read_text())
    for refit in (DECODE_REFIT, PREFILL_REFIT):
        if (out_dir / refit).is_file():
            data.update(json.loads((out_dir / refit).read_text()))
    shape = {k: int(model_config[hf]) for k, hf in SHAPE_KEYS.items()}
    kv_per_token = (2 * shape["num_layers"] * shape["num_kv_heads"]
                    * (shape["hidden_size"] // shape["num_heads"]) * dtype_bytes)
    data["live"] = {"transfer_bandwidth_bytes_per_s": bandwidth,
                    "kv_pool_tokens": KV_POOL_BYTES // kv_per_token, "shape": shape,
                    "dtype_bytes": dtype_bytes,
                    "topology": {"num_prefill": 1, "num_decode": 1}}
    if contention is not None:
        data["live"]["contention"] = contention
    return data


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


def recorded_replay(system: str, cap_args: Any, regime: Regime, budget: int,
                    planned: list[PlannedRequest],
                    pin: bool) -> tuple[list[RequestResult], dict[str, Any]]:
    """One replay on a fresh `system` server (pin_workers = `pin`) with what could differ
    between invocations recorded (benchmarks/replay_env.py): workers' threads, affinity and
    placement, the GEMM tables and whether they were measured or loaded, /proc/stat, load,
    MHz, and the decode worker's step times from its step trace."""
    import os
    import tempfile

    from kvcake.engine import cpu_ops
    from kvcake.engine.step_trace import ENV

    toml = cap.kvcake_toml
    threads = {"prefill": 1, "decode": 1, "colocated": 1}  # cap.kvcake_toml's num_threads
    env = replay_env.ReplayEnv(cpu_ops.cache_dir(), pin, threads)
    cap.kvcake_toml = lambda *a: f"pin_workers = {str(pin).lower()}\n" + toml(*a)
    try:
        with tempfile.TemporaryDirectory(prefix="kvcake-steps-") as trace_dir:
            os.environ[ENV] = trace_dir  # the server and its workers inherit it
            try:
                env.start()
                with cap.Served(system, cap_args, regime,
                                budget if system == "colocated" else None) as served:
                    assert served.server is not None and served.server.sid is not None
                    env.attach(served.server.sid)
                    begun = time.monotonic()
                    try:
                        results = served.replay(planned)[0]
                    finally:
                        env.stop()
            finally:
                del os.environ[ENV]
            steps = [json.loads(line) for path in sorted(Path(trace_dir).glob("steps-*.jsonl"))
                     if "decode" in path.stem or system == "colocated"
                     for line in path.read_text().splitlines()]
    finally:
        cap.kvcake_toml = toml
    report = env.report()
    report["admission"] = cap_args.disagg_admission if system == "disagg" else "none"
    report["decode_steps"] = replay_env.step_split(
        steps, [g for r in results for g in r.gaps_s], begun)
    return results, report


def live_metrics(results: list[RequestResult], regime: Regime) -> dict[str, float]:
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
    for k, share in enumerate(cap.shares(results, regime)):
        out[f"effective_share_slo{k + 1}"] = share
    return out


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


def fit_factor(target: float, measure: Any, lo: float = 0.5, hi: float = 8.0,
               steps: int = 14) -> float:
    """The factor f in [lo, hi] with measure(f) ~ target, by bisection on a log scale
    (measure grows with f; the bounds when the target lies outside)."""
    if measure(lo) >= target:
        return lo
    if measure(hi) <= target:
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if measure(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def fit_contention(profile: dict[str, Any], live: dict[str, float], trace: Trace,
                   regime: Regime, config: SimConfig) -> dict[str, float]:
    """Per-host factors from one live disaggregated run: prefill so the simulated TTFT p50
    matches the live one, decode so the TBT p50 does (each other factor held; twice round)."""
    factors = {"decode": 1.0, "prefill": 1.0}

    def metric(name: str, key: str) -> Any:
        def measure(f: float) -> float:
            data = dict(profile, live={**profile["live"], "contention": {**factors, name: f}})
            cost = live_cost_from_dict(data).as_cost_model()
            return 1000 * simulate(config, trace, cost).summary[key]["p50"]
        return measure

    for _ in range(2):
        factors["prefill"] = fit_factor(live["ttft_p50_ms"], metric("prefill", "ttft_s"))
        factors["decode"] = fit_factor(live["tbt_p50_ms"], metric("decode", "tbt_s"))
    return {k: round(v, 4) for k, v in factors.items()}


def sim_configs(regime: Regime, block_len: int, budget: int,
                admission: str = "none") -> dict[str, SimConfig]:
    """The live systems as the simulator runs them: the disaggregated pair with the live run's
    admission (`--disagg-admission`) on the regime's TTFT SLO and loosest TBT SLO, as
    serving_disagg_vs_colocated.conductor_toml configures the live Conductor; the colocated pair
    never rejects."""
    common = {"ttft_slo_s": regime.ttft_slo_s, "tbt_slo_ms": max(regime.tbt_slos_ms),
              "block_size": block_len, "seed": 0}
    pool_tokens = KV_POOL_BYTES // 4096
    return {
        "disagg": SimConfig(num_prefill=1, num_decode=1, policy="global_cache",
                            store_tokens=pool_tokens, admission=admission,
                            **common),  # type: ignore[arg-type]
        "colocated": SimConfig(num_prefill=1, num_decode=1, policy="colocated",
                               chunked_prefill=True, chunk_budget_tokens=budget,
                               max_batch_size=min(64, budget - 1), admission="none",
                               **common),  # type: ignore[arg-type]
    }


def sim_capacity(records: list[TraceRequest], regime: Regime, cost: Any, budget: int,
                 vocab_size: int, admission: str = "none") -> dict[str, list[float | None]]:
    """The simulator's capacity per TBT SLO for the same regime: the capacity benchmark's search
    (start rate, probes, 90% target) over the same requests, each probe one simulated run."""
    block_len = PromptBuilder(scale_tokens=regime.scale_tokens).block_len
    out: dict[str, list[float | None]] = {}
    for name, config in sim_configs(regime, block_len, budget, admission).items():
        def probe(rate: float, config: SimConfig = config) -> list[float]:
            planned = cap.workload(records, regime, vocab_size, rate, seed=0)
            return sim_shares(simulate(config, sim_trace(records, planned, block_len),
                                       cost).states, regime)

        found = find_capacities(probe, 0.5 / regime.mean_prefill_s, len(regime.tbt_slos_ms),
                                cap.TARGET_SHARE, regime.max_probes)
        out[name] = list(found.best_speeds)
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
                             data.get("admission", "none"))[system]  # as the probes ran
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
    return fit_factor(tpot_ms, measure)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)
    if args.live_only and args.sim_only:
        p.error("--live-only and --sim-only exclude each other: pass one")
    if args.append_replays and args.sim_only:
        p.error("--append-replays adds replays; --sim-only replays nothing: pass one")
    if args.colocated_by_rows and args.colocated_terms is None:
        p.error("--colocated-by-rows needs --colocated-terms SAVED (the step trace it measures)")
    cap_args = cap.parse_args(["--out-dir", str(args.out_dir),
                               "--disagg-admission", args.disagg_admission])
    regime = cap.load_regime(cap_args)
    budget_path = args.out_dir / "colocated-budget.json"
    if not budget_path.is_file():
        raise SystemExit(f"{budget_path} not found: run serving_disagg_vs_colocated.py "
                         "--systems colocated-budget first")
    budget = int(json.loads(budget_path.read_text())["chunk_budget"])
    model_config = cap.prepare_model(cap_args)
    if args.refit_decode or args.refit_prefill:
        if args.refit_decode:
            print(json.dumps(refit_decode(args.out_dir, cap_args.model_dir)))
        if args.refit_prefill:
            print(json.dumps(refit_prefill(args.out_dir, cap_args.model_dir)))
        return 0
    cap_args.vocab_size = model_config.vocab_size
    rate = args.rate or 0.5 / regime.mean_prefill_s
    records = cap.records_of(cap_args.trace, regime.num_requests)
    planned = cap.workload(records, regime, cap_args.vocab_size, rate, args.seed)
    block_len = PromptBuilder(scale_tokens=regime.scale_tokens).block_len
    systems = [x for x in args.systems.split(",") if x]

    def live_at(rate_: float, name: str, replay: bool) -> dict[str, Any]:
        """The live metrics at rate_ (benchmarks/live_replays.py replay_file): --live-repeats
        replays of --systems (unless --sim-only), each on a fresh server."""
        plan_ = cap.workload(records, regime, cap_args.vocab_size, rate_, args.seed)

        envs: list[dict[str, Any]] = []

        def replay_once(system: str) -> list[RequestResult]:
            results, env = recorded_replay(system, cap_args, regime, budget, plan_,
                                           args.pin == "on")
            envs.append(env)
            return results

        return live_replays.replay_file(args.out_dir / name, rate_, systems, args.live_repeats,
                                        replay_once, lambda rs: live_metrics(rs, regime),
                                        replay=replay and not args.sim_only,
                                        extras=lambda: envs.pop(),
                                        append=args.append_replays)

    live_file, fit_file = live_replays.check_files(rate, args.fit_rate, args.replay_rates,
                                                   live_at)
    if args.live_only:
        return 0
    for checked in (live_file, fit_file):
        live_replays.check_admission(checked, args.disagg_admission)
    live, live_reps = live_file["metrics"], live_file["replays"]
    fit_live, fit_reps = (fit_file["metrics"], fit_file["replays"]) if fit_file else (None, {})
    config_json = json.loads((cap_args.model_dir / "config.json").read_text())
    bandwidth, source = transfer_bandwidth(args.out_dir)
    profile = live_profile(args.out_dir, config_json, bandwidth)
    configs = sim_configs(regime, block_len, budget, args.disagg_admission)
    contention = None
    fit_metrics = None
    terms = None
    if args.host_terms is not None:
        base = live_cost_from_dict(profile)
        terms = host_terms.measure(host_terms.load_saved(args.host_terms), base.decode,
                                   base.prefill)
        profile = host_terms.with_terms(profile, terms)
        print(f"host terms measured from {args.host_terms}: {json.dumps(terms)}")
    coloc = None
    if args.colocated_terms is not None:
        base = live_cost_from_dict(profile)
        coloc = colocated_terms.measure(host_terms.load_saved(args.colocated_terms),
                                        base.decode, base.prefill, by_rows=args.colocated_by_rows)
        profile = {**profile, "live": {**profile["live"], "colocated": coloc["colocated"]}}
        print(f"colocated terms measured from {args.colocated_terms}: "
              f"{json.dumps(coloc['colocated'])}")
    jitters = {"disagg": terms["step_jitter_quantiles"] if terms else None,
               "colocated": coloc["step_jitter_quantiles"] if coloc else None}
    if args.colocated_series is not None:
        saved = host_terms.load_saved(args.colocated_series)
        plan_ = cap.workload(records, regime, cap_args.vocab_size, saved["rate"],
                             args.seed)[:len(saved["requests"])]
        saved_trace = sim_trace(records[:len(plan_)], plan_, block_len)
        saved_cost = live_cost_from_dict(profile).as_cost_model()
        steps = colocated_terms.compare_steps(saved, saved_trace, configs["colocated"],
                                              saved_cost)
        colocated_terms.print_compare(steps)
        same_run = compare({"colocated": live_metrics(host_terms.results_of(saved), regime)},
                           {"colocated": sim_metrics(saved_trace, regime, configs["colocated"],
                                                     saved_cost, jitters["colocated"])})
        print_table(f"the saved colocated run ({saved['rate']:.3g}/s, {len(plan_)} requests)",
                    same_run)
        if args.json:
            print(json.dumps({"colocated_steps": steps, "colocated_terms": coloc,
                              "metrics": same_run}))
        return 0
    if args.batch_series is not None:
        saved = host_terms.load_saved(args.batch_series)
        plan_ = cap.workload(records, regime, cap_args.vocab_size, saved["rate"],
                             args.seed)[:len(saved["requests"])]
        saved_trace = sim_trace(records[:len(plan_)], plan_, block_len)
        saved_cost = live_cost_from_dict(profile).as_cost_model()
        series = host_terms.batch_series(saved, saved_trace, configs["disagg"], saved_cost)
        host_terms.print_series(series)
        jitter = terms["step_jitter_quantiles"] if terms else None
        same_run = compare({"disagg": live_metrics(host_terms.results_of(saved), regime)},
                           {"disagg": sim_metrics(saved_trace, regime, configs["disagg"],
                                                  saved_cost, jitter)})
        print_table(f"the saved run ({saved['rate']:.3g}/s, {len(plan_)} requests)", same_run)
        if args.json:
            print(json.dumps({"batch_series": series, "host_terms": terms,
                              "metrics": same_run}))
        return 0
    if (terms is not None or coloc is not None) and fit_live is not None:  # nothing fitted
        fit_plan = cap.workload(records, regime, cap_args.vocab_size, args.fit_rate, args.seed)
        fit_cost = live_cost_from_dict(profile).as_cost_model()
        fit_metrics = live_replays.annotate(compare(fit_live, {
            name: sim_metrics(sim_trace(records, fit_plan, block_len), regime, config, fit_cost,
                              jitters[name])
            for name, config in configs.items() if name in fit_live}), fit_reps)
        print_table(f"second check rate {args.fit_rate:.3g}/s", fit_metrics)
    elif fit_live is not None and "disagg" in fit_live:
        fit_plan = cap.workload(records, regime, cap_args.vocab_size, args.fit_rate, args.seed)
        fit_trace = sim_trace(records, fit_plan, block_len)
        contention = fit_contention(profile, fit_live["disagg"], fit_trace, regime,
                                    configs["disagg"])
        profile = live_profile(args.out_dir, config_json, bandwidth, contention=contention)
        fit_cost = live_cost_from_dict(profile).as_cost_model()
        fit_metrics = live_replays.annotate(
            compare(fit_live, {name: sim_metrics(fit_trace, regime, config, fit_cost)
                               for name, config in configs.items() if name in fit_live}),
            fit_reps)
        print(f"contention fitted at {args.fit_rate:.3g}/s (disagg TTFT/TBT p50): "
              f"{json.dumps(contention)}")
        print_table(f"fit rate {args.fit_rate:.3g}/s", fit_metrics)
    (args.out_dir / "live_profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    cost = live_cost_from_dict(profile).as_cost_model()
    trace = sim_trace(records, planned, block_len)
    sim = {name: sim_metrics(trace, regime, config, cost, jitters[name])
           for name, config in configs.items() if name in live}
    metrics = live_replays.annotate(compare(live, sim), live_reps)
    print(f"rate {rate:.3g}/s, {len(planned)} requests, block {block_len} tokens, transfer "
          f"bandwidth {bandwidth / 1e9:.2f} GB/s ({source}), colocated budget {budget}")
    print_table(f"{'check ' if contention else ''}rate {rate:.3g}/s", metrics)
    diag = {name: diagnostics(trace, config, cost) for name, config in configs.items()
            if name in live}
    print(f"simulated at {rate:.3g}/s: {json.dumps(diag)}")
    check = None
    if args.check_capacity is not None:
        check = capacity_check(args.check_capacity, regime, records, cost, budget,
                               cap_args.vocab_size)
        print_capacity_check(check)
    if not args.no_capacity:
        capacity = sim_capacity(records, regime, cost, budget, cap_args.vocab_size,
                                args.disagg_admission)
        (args.out_dir / "sim_capacity.json").write_text(json.dumps(capacity) + "\n")
        print(f"simulated capacity (req/s) per TBT SLO "
              f"{[round(x, 1) for x in regime.tbt_slos_ms]}: {json.dumps(capacity)}")
    if args.json:
        out: dict[str, Any] = {"metrics": metrics, "diagnostics": diag,
                               "live_repeats": {s_: len(r) for s_, r in live_reps.items()},
                               "live_noise_floor": live_replays.noise_floor(metrics)}
        if check is not None:
            out["capacity_check"] = check
        if contention is not None:
            out |= {"contention": contention, "fit_rate": args.fit_rate,
                    "fit_metrics": fit_metrics}
        elif terms is not None:
            out |= {"host_terms": terms, "second_rate": args.fit_rate,
                    "second_rate_metrics": fit_metrics}
        if coloc is not None:
            out["colocated_terms"] = coloc
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
