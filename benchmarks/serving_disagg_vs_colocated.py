r"""Disaggregated 1P+1D (+ store) vs 2 colocated kvcake workers vs vLLM's CPU build: capacity in
the paper's regime, fixed in advance (issue 11 part 2); and the KV hand-off's transport runs.

    B=benchmarks/serving_disagg_vs_colocated.py; D=/tmp/kvcake-capacity
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --measure-regime
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --systems colocated-budget
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --systems disagg
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --systems colocated
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --out-dir $D --systems vllm
    .venv/bin/python $B --out-dir $D --merge --json     # the three capacities, the gains
    flock /tmp/kvcake_bench.lock .venv/bin/python $B --transport --transport-runs 3

Each step fits one 15-minute hold of the shared bench lock on 2 cores; every step writes its JSON
into --out-dir and --merge reads them back. Without --systems/--merge/--transport the script runs
all steps in order.

## The regime (kvcake/bench/regime.py), derived before any system runs
The paper's setting in ratios that carry over to any hardware: the mean prompt's cold prefill is
~1.44 s, a decode step ~45 ms (ratio ~32); TBT SLOs 100/200/300 ms = 2.2/4.4/6.6 decode steps;
TTFT SLO 30 s = ~21 mean prefills; the conversation trace's outputs (mean ~343 tokens).
`--measure-regime` measures on this machine, once, with the model all three systems serve (the
44M-parameter Llama directory of `benchmarks/serving_vs_vllm.py`: 4 layers, hidden 512, vocab
32,000, context 32,768; seeded weights, float32) on one engine with 1 torch thread (what each
kvcake worker gets on 2 cores):
- prefill: a grid of cold prompts (256..8,192 tokens) -> the fitted `PrefillTimePredictor`
  prefill_s(L) of one prefill worker (`kvcake profile`'s fit; saved as `profile.json`, the live
  profile `benchmarks/sim_vs_live.py` hands to the simulator);
- decode: steps at batch 1/8/16 x context 256/2,048 tokens -> the fitted step model s(B, ctx).
Then, with pure functions:
- typical decode batch B = rho * mean_output / 32 (Little's law for 1P+1D with the prefill worker
  busy rho = 0.75 of the time; independent of the hardware) = 8 for these records;
- s_d = s(B, B * (L + mean_output / 2)) and L = the prompt length with prefill_s(L) = 32 s_d
  (iterated to a fixed point), capped at context - 1,024;
- scale = L / (mean trace prompt of the replayed records): every prompt length and the 512-token
  hash block are multiplied by it (prefix sharing kept); prompts cut at context - 1,024;
- outputs: the trace's, capped at 1,024 tokens (not scaled);
- TBT SLOs = 2.2/4.4/6.6 s_d; TTFT SLO = 21 prefill_s(L).
Every system then runs with the regime file as written; nothing is changed after a result.

## The requests and the capacity search
The first --num-requests (40) records of the conversation trace, in order. Arrivals: seeded
Poisson (exponential gaps) at rate r; the trace's own timestamps have 3-s granularity with bursts
of up to 16 simultaneous requests in the first 40, which would make 40-request capacities a
property of two bursts. Each probe uses fresh prompt tokens (seed = the probe's index), so a
probe never hits the cache of an earlier one; the sharing inside a probe is the trace's. The
same (rate, probe index) gives identical requests to every system. A request is effective when
TTFT <= the TTFT SLO and its TBT (mean of its slowest 10% of token gaps) <= the TBT SLO; one
replay gives the share at all three TBT SLOs. Capacity per SLO = the highest rate with >= 90%
effective (`kvcake.bench.capacity.find_capacities`: doubling from r0 = 0.5 / mean prefill, then
geometric bisection to 10%, at most --max-probes per SLO, a rate never replayed twice; SLO k
starts from SLO k-1's capacity). Bounded so that one system's step fits one 15-minute lock hold
on 2 cores (a probe lasts ~N / rate): rates below 1/4 of r0 are not replayed (a capacity there is
reported as below that floor, null), and no probe starts that would end past 780 s of replays
(the capacities are then those the probes run support; `complete` false in the step's JSON).
Probes are written to `<step>.partial.json` as they end; a rerun of the step reuses them.

Admission: the disaggregated pair is MOONCAKE, whose Conductor (Algorithm 1) answers HTTP 429 at
arrival when the predicted TTFT or TBT would break its SLO; it runs with the admission `kvcake
serve` ships (`--disagg-admission early`) against the regime's TTFT SLO and its loosest TBT SLO, so
one replay still gives all three shares (a rejected request counts as a miss at every SLO). The
colocated pair and vLLM never reject, as the simulator's colocated baselines do not. Until
2026-12-07 every system ran without admission (`--disagg-admission none` still does): the
disaggregated pair then served even a prompt whose own prefill outlasts the TTFT SLO (the 40
records' longest, 20,826 scaled tokens), and everything behind it in its one prefill worker's
queue waited it out (docs/benchmarks.md, issue 11 on the AVX-512 machine).

Systems, one at a time on 127.0.0.1, each warmed up the same way (benchmarks/serving_vs_vllm.py):
- `disagg`: `kvcake serve --config` 1 prefill + 1 decode worker (1 thread each), policy
  global_cache with the store, layer-wise KV streaming over shared memory, admission as above;
- `colocated`: 2 colocated kvcake workers (1 thread each; prefix caching and chunked prefill),
  policy colocated, at the prefill-chunk budget `colocated-budget` picked: one replay per budget
  in {64, 256, 1024, 2048} at the fixed rate 1 / mean prefill (the pair's prefill half busy);
  the budget with the highest sum of effective shares over the three SLOs wins (ties: larger);
- `vllm`: vLLM's CPU build, one server with both cores (OpenMP bind 0-1), prefix caching and
  chunked prefill (its default 2,048-token budget), float32, via ../shared/tools/peers (set up
  by this script when the venv is missing).

`--json` prints {"s_d_ms", "tbt_slo_ms", "capacity_rps": {"disagg", "colocated", "vllm"}} (a
capacity is null when even the lowest probed rate fails, or the system was not run).

## `--transport`: the KV hand-off, layer-wise vs after the prefill
Its runs and what they report: benchmarks/kv_handoff_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own modules

import kv_handoff_runs  # noqa: E402
from capacity_regime import (  # noqa: E402
    load_regime,
    measure_regime,
    prepare_model,
    records_of,
)
from capacity_systems import STEPS, Served  # noqa: E402

from kvcake.bench.capacity import find_capacities  # noqa: E402
from kvcake.bench.prompts import PromptBuilder  # noqa: E402
from kvcake.bench.regime import Regime  # noqa: E402
from kvcake.bench.replay import PlannedRequest  # noqa: E402
from kvcake.bench.stats import RequestResult, effective_shares, summarize  # noqa: E402
from kvcake.sim.trace import TraceRequest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = STEPS[1:]  # disagg, colocated, vllm: the steps that search a capacity
BUDGETS = (64, 256, 1024, 2048)
TARGET_SHARE = 0.9


# ---- the requests -------------------------------------------------------------------------------

def arrival_offsets(n: int, seed: int = 0) -> list[float]:
    """Poisson arrivals at rate 1 (seeded): offsets of n requests, the first at 0; divide by r."""
    gaps = np.random.default_rng(seed).exponential(1.0, max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def workload(records: list[TraceRequest], regime: Regime, vocab_size: int, rate: float,
             seed: int) -> list[PlannedRequest]:
    """The regime's requests at `rate` per second; prompt tokens seeded by `seed`."""
    builder = PromptBuilder(vocab_size=vocab_size, scale_tokens=regime.scale_tokens, seed=seed)
    offsets = arrival_offsets(len(records))
    return [PlannedRequest(t / rate,
                           builder.build(r.hash_ids, r.input_len, r.index)[:regime.max_prompt_len],
                           min(max(1, r.output_len), regime.max_output_len))
            for t, r in zip(offsets, records, strict=True)]


def shares(results: list[RequestResult], regime: Regime) -> list[float]:
    """Effective share of all sent requests under each TBT SLO (and the TTFT SLO)."""
    return effective_shares(results, regime.ttft_slo_s, [x / 1000.0 for x in regime.tbt_slos_ms])


def probe_summary(results: list[RequestResult], duration_s: float, regime: Regime,
                  rate: float) -> dict[str, Any]:
    report = summarize(results, duration_s, regime.ttft_slo_s, regime.tbt_slos_ms[1] / 1000.0)
    keep = ("completed", "failed", "rejected", "median_ttft_ms", "p90_ttft_ms", "median_tbt_ms",
            "p90_tbt_ms", "mean_tpot_ms", "duration")
    return {"rate": rate, "shares": shares(results, regime), **{k: report[k] for k in keep},
            "errors": report["error_messages"][:3]}


RATE_FLOOR = 0.25  # of the start rate: lower rates are not replayed (a probe lasts N / rate)
SEARCH_BUDGET_S = 780.0  # of replays per system step: the step fits one 15-minute lock hold


class _OutOfTime(Exception):
    pass


def capacities_from(probes: list[dict[str, Any]], num_slos: int) -> list[float | None]:
    """Per SLO, the highest passing rate below the lowest failing one (the search's answer when
    it completes; its best estimate from the probes run when the time budget stopped it)."""
    out: list[float | None] = []
    for k in range(num_slos):
        failing = min((p["rate"] for p in probes if p["shares"][k] < TARGET_SHARE),
                      default=float("inf"))
        passing = [p["rate"] for p in probes
                   if p["shares"][k] >= TARGET_SHARE and p["rate"] < failing]
        out.append(max(passing) if passing else None)
    return out


def search(served: Served, records: list[TraceRequest], regime: Regime,
           partial: Path | None = None) -> dict[str, Any]:
    """`find_capacities` from 0.5 / mean prefill; rates below RATE_FLOOR x that are not replayed
    (they count as failing: such a capacity is reported as below the floor); replays stop after
    SEARCH_BUDGET_S (a probe that would end past it is not started; then the capacities are those the probes so far support, `complete`
    false). Each probe is written to `partial` as it ends; probes already there (an earlier,
    interrupted run of this step, same regime) are reused, not replayed."""
    start_rate = 0.5 / regime.mean_prefill_s
    floor = RATE_FLOOR * start_rate
    probes: list[dict[str, Any]] = []
    done: dict[float, list[float]] = {}
    if partial is not None and partial.is_file():
        for old in json.loads(partial.read_text()).get("probes", []):
            done[float(old["rate"])] = list(old["shares"])
            probes.append(old)
    began = time.perf_counter()

    def probe(rate: float) -> list[float]:
        for old_rate, old_shares in done.items():
            if abs(old_rate - rate) <= 1e-6 * rate:
                return old_shares
        if rate < floor * (1 - 1e-9):
            return [0.0] * len(regime.tbt_slos_ms)
        expected_s = len(records) / rate + 20.0  # arrivals, then the last requests' decode
        if time.perf_counter() - began + expected_s > SEARCH_BUDGET_S:
            raise _OutOfTime
        planned = workload(records, regime, served.args.vocab_size, rate,
                           seed=1000 + len(probes))
        results, duration = served.replay(planned)
        probes.append(probe_summary(results, duration, regime, rate))
        got = probes[-1]
        done[rate] = got["shares"]
        if partial is not None:
            partial.write_text(json.dumps({"probes": probes}, indent=1) + "\n")
        print(f"[{served.kind}] rate {rate:.3g}/s: shares {[round(s, 3) for s in got['shares']]}"
              f" TTFT p50/p90 {got['median_ttft_ms']:.0f}/{got['p90_ttft_ms']:.0f} ms, TBT "
              f"p50/p90 {got['median_tbt_ms']:.1f}/{got['p90_tbt_ms']:.1f} ms "
              f"({duration:.0f} s)", file=sys.stderr, flush=True)
        return got["shares"]

    complete = True
    try:
        find_capacities(probe, start_rate, len(regime.tbt_slos_ms), TARGET_SHARE,
                        regime.max_probes)
    except _OutOfTime:
        complete = False
    return {"capacity_rps": capacities_from(probes, len(regime.tbt_slos_ms)), "probes": probes,
            "start_rate": start_rate, "rate_floor": floor, "complete": complete}


def run_step(step: str, args: argparse.Namespace, regime: Regime) -> dict[str, Any]:
    records = records_of(args.trace, regime.num_requests)
    begun = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    started = time.perf_counter()
    result: dict[str, Any]
    if step == "colocated-budget":
        rate = 1.0 / regime.mean_prefill_s
        per_budget = {}
        for budget in BUDGETS:
            with Served("colocated", args, regime, budget) as served:
                planned = workload(records, regime, args.vocab_size, rate, seed=500)
                results, duration = served.replay(planned)
                per_budget[budget] = probe_summary(results, duration, regime, rate)
                print(f"[colocated-budget] {budget}: shares {per_budget[budget]['shares']}",
                      file=sys.stderr, flush=True)
        best = max(BUDGETS, key=lambda b: (sum(per_budget[b]["shares"]), b))
        result = {"rate": rate, "per_budget": per_budget, "chunk_budget": best}
    else:
        budget = None
        if step == "colocated":
            path = args.out_dir / "colocated-budget.json"
            if not path.is_file():
                raise SystemExit(f"{path} not found: run --systems colocated-budget first")
            budget = int(json.loads(path.read_text())["chunk_budget"])
        with Served(step, args, regime, budget) as served:
            before = served.counters()
            result = search(served, records, regime, args.out_dir / f"{step}.partial.json")
            after = served.counters()
            result["counters"] = {k: after[k] - before.get(k, 0.0) if k.endswith("_total")
                                  else after[k] for k in after}
        result["chunk_budget"] = budget
        if step == "disagg":
            result["admission"] = args.disagg_admission
        result["prefill_speed_weight"] = args.prefill_speed_weight
    result |= {"started": begun, "load_before": load_before, "load_after": os.getloadavg(),
               "wall_s": time.perf_counter() - started}
    (args.out_dir / f"{step}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def merged(out_dir: Path) -> dict[str, Any]:
    regime = Regime.from_json((out_dir / "regime.json").read_text())
    capacity: dict[str, list[float | None]] = {}
    for name in SYSTEMS:
        path = out_dir / f"{name}.json"
        capacity[name] = (json.loads(path.read_text())["capacity_rps"] if path.is_file()
                          else [None] * len(regime.tbt_slos_ms))
    return {"s_d_ms": regime.s_d_s * 1000.0, "tbt_slo_ms": list(regime.tbt_slos_ms),
            "capacity_rps": capacity}


def gains(result: dict[str, Any]) -> dict[str, list[float | None]]:
    cap = result["capacity_rps"]
    out = {}
    for base in ("colocated", "vllm"):
        out[f"disagg/{base}"] = [None if a is None or not b else a / b
                                 for a, b in zip(cap["disagg"], cap[base], strict=True)]
    return out


def print_capacity(result: dict[str, Any]) -> None:
    print(f"s_d = {result['s_d_ms']:.2f} ms; TBT SLOs "
          f"{', '.join(f'{x:.1f}' for x in result['tbt_slo_ms'])} ms")
    print(f"| TBT SLO (ms) | {' | '.join(SYSTEMS)} (req/s) | disagg/colocated | disagg/vllm |")
    print("|---" * (len(SYSTEMS) + 3) + "|")  # SLO, each system, the two gains
    g = gains(result)

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3g}"

    for i, slo in enumerate(result["tbt_slo_ms"]):
        caps = " | ".join(fmt(result["capacity_rps"][n][i]) for n in SYSTEMS)
        print(f"| {slo:.1f} | {caps} | {fmt(g['disagg/colocated'][i])} | "
              f"{fmt(g['disagg/vllm'][i])} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path,
                   default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/kvcake-capacity"),
                   help="regime.json, profile.json and one JSON per step go here")
    p.add_argument("--measure-regime", action="store_true",
                   help="measure s_d and the prefill model, write regime.json (then stop unless "
                        "--systems is given)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated steps to run, of {', '.join(STEPS)}")
    p.add_argument("--merge", action="store_true", help="only read the step files and report")
    p.add_argument("--json", action="store_true",
                   help='print {"s_d_ms", "tbt_slo_ms", "capacity_rps": {...}} last')
    p.add_argument("--num-requests", type=int, default=40,
                   help="trace records per replay (fixed in regime.json by --measure-regime)")
    p.add_argument("--max-probes", type=int, default=4,
                   help="capacity probes per TBT SLO (fixed in regime.json)")
    p.add_argument("--tokenizer-dir", type=Path, default=Path("/tmp/vllm-tiny-llama"))
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kvcake-vs-vllm-model"))
    p.add_argument("--seed", type=int, default=0, help="the model's weights")
    p.add_argument("--port-base", type=int, default=25000)
    p.add_argument("--disagg-admission", choices=("early", "slo", "none"), default="early",
                   help="the disaggregated pair's admission (Algorithm 1's HTTP 429 on the "
                        "regime's TTFT SLO and loosest TBT SLO; default early, what `kvcake "
                        "serve` runs; none: every request served, as before 2026-12-07)")
    p.add_argument("--prefill-speed-weight", type=float, default=0.0,
                   help="both kvcake pairs' Conductors learn each prefill instance's speed from "
                        "its finished prefills with this weight ([conductor] "
                        "prefill_speed_weight; default 0: the fitted predictions, as every run "
                        "before 2026-12-07)")
    p.add_argument("--transport", action="store_true",
                   help="run only the KV hand-off comparison (tiny preset)")
    p.add_argument("--transport-runs", type=int, default=3)
    p.add_argument("--streaming-requests", type=int, default=20)
    p.add_argument("--streaming-prompt-len", type=int, default=1500)
    p.add_argument("--transport-requests", type=int, default=20,
                   help="requests per transport and mode in the shm / tcp comparison (0: skip)")
    args = p.parse_args(argv)
    args.model_dir = args.model_dir.resolve()
    args.steps = [] if args.systems is None else [s.strip() for s in args.systems.split(",")
                                                  if s.strip()]
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(STEPS)}")
    if args.num_requests < 10 or args.max_probes < 1:
        p.error("--num-requests must be >= 10 and --max-probes >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.transport:
        out = kv_handoff_runs.transport_main(args)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "transport.json").write_text(json.dumps(out, indent=1) + "\n")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    everything = not (args.measure_regime or args.steps or args.merge)
    if args.measure_regime or (everything and not (args.out_dir / "regime.json").is_file()):
        regime = measure_regime(args)
        (args.out_dir / "regime.json").write_text(regime.to_json() + "\n")
        print(f"[regime] {regime.to_json()}", file=sys.stderr)
    steps = list(STEPS) if everything else args.steps
    if steps:
        regime = load_regime(args)
        args.vocab_size = prepare_model(args).vocab_size
        for step in steps:
            run_step(step, args, regime)
    if args.merge or everything or steps:
        result = merged(args.out_dir)
        print_capacity(result)
        if args.json:
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
