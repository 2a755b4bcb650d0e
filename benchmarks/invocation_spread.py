r"""Live replays of separate invocations side by side, with what each ran on (issue 11 part 3).

    .venv/bin/python benchmarks/invocation_spread.py /tmp/simlive11/inv*.json [--json]

Each argument is a `sim_vs_live.py` live file (`live.json`, usually of `--live-repeats 1
--live-only`, one per invocation) whose runs carry `env` (benchmarks/replay_env.py). Prints one
row per replay: its start, pin_workers, the GEMM table's use (measured / loaded) and hash, the
client TBT p50 (the paper's TBT, over its requests) and mean gap, the decode worker's step wall
p50 and mean, step CPU p50, wall / CPU, the gap time outside the decode step, the decode and
prefill workers' run-queue wait shares, how often their busiest threads were seen on one CPU,
the machine's steal and idle shares over the replay, its load average and MHz; then, across
replays, the Pearson correlation of the decode step's mean wall (and the client TBT p50) with
each numeric variable. Arithmetic only; the replays are the caller's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcake.bench.stats import paper_tbt_s

NUMERIC = ("tbt_p50_ms", "gap_mean_ms", "step_wall_p50_ms", "step_wall_mean_ms",
           "step_cpu_p50_ms", "wall_over_cpu", "gap_outside_step_ms", "decode_wait_share",
           "prefill_wait_share", "same_cpu_share", "steal_share", "idle_share", "load_1m",
           "mhz_mean", "pinned", "table_measured")


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The correlation of two equally long series (None: under 3 points or a constant one)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True)
             if x is not None and y is not None and not (math.isnan(x) or math.isnan(y))]
    if len(pairs) < 3:
        return None
    a, b = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    if a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def rows_of(name: str, live: dict[str, Any], system: str = "disagg") -> list[dict[str, Any]]:
    """One row per replay of `system` in a live file (replays without `env` are skipped)."""
    rows = []
    for k, (run, requests) in enumerate(zip(live["runs"].get(system, []),
                                            live["requests"].get(system, []), strict=True)):
        env = run.get("env")
        if env is None:
            continue
        tbts = [paper_tbt_s(r["gaps_s"]) for r in requests if r["gaps_s"]]
        gaps = [g for r in requests for g in r["gaps_s"]]
        steps = env.get("decode_steps", {})
        workers = {w["role"]: w for w in env.get("workers", {}).values()}
        tables = env.get("gemm_tables", {})
        t1 = next((v for n, v in tables.items() if n.endswith("-t1.json")), None)
        mhz = env.get("mhz_before", []) + env.get("mhz_after", [])
        cpu = env.get("proc_stat", {}).get("cpu", {})

        rows.append({
            "name": f"{name}#{k + 1}", "at": run["before"]["at"][11:19],
            "pinned": float(bool(env.get("pin_workers"))),
            "table": "" if t1 is None else f"{t1['use']}:{t1['sha256_16'][:6]}",
            "table_measured": None if t1 is None else float(t1["use"] == "measured"),
            "tbt_p50_ms": 1000 * float(np.percentile(tbts, 50)) if tbts else None,
            "gap_mean_ms": 1000 * float(np.mean(gaps)) if gaps else None,
            "step_wall_p50_ms": steps.get("step_wall_ms_p50"),
            "step_wall_mean_ms": steps.get("step_wall_ms_mean"),
            "step_cpu_p50_ms": steps.get("step_cpu_ms_p50"),
            "wall_over_cpu": steps.get("wall_over_cpu"),
            "gap_outside_step_ms": steps.get("gap_outside_step_ms"),
            "decode_wait_share": _wait(workers, "decode"),
            "prefill_wait_share": _wait(workers, "prefill"),
            "same_cpu_share": env.get("decode_prefill_same_cpu"),
            "decode_affinity": workers.get("decode", {}).get("affinity"),
            "decode_ran_on": workers.get("decode", {}).get("ran_on_ticks"),
            "prefill_ran_on": workers.get("prefill", {}).get("ran_on_ticks"),
            "steal_share": cpu.get("steal"), "idle_share": cpu.get("idle"),
            "load_1m": env.get("load_before", [None])[0],
            "mhz_mean": float(np.mean(mhz)) if mhz else None,
        })
    return rows


def _wait(workers: dict[str, Any], role: str) -> float | None:
    share = workers.get(role, {}).get("run_queue", {}).get("wait_share")
    return None if share is None else float(share)


def correlations(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per target (the decode step's mean wall, the client TBT p50): its correlation with each
    other numeric column across the rows."""
    out = {}
    for target in ("step_wall_mean_ms", "tbt_p50_ms"):
        ys = [r[target] for r in rows]
        out[target] = {c: pearson([r[c] for r in rows], ys) for c in NUMERIC if c != target}
    return out


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return "-" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="sim_vs_live.py live files")
    p.add_argument("--system", choices=("disagg", "colocated"), default="disagg")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [row for f in args.files
            for row in rows_of(f"{f.parent.name}/{f.stem}", json.loads(f.read_text()),
                                args.system)]
    if not rows:
        raise SystemExit("no replay with a recorded env in these files: replay them with "
                         "sim_vs_live.py (it records benchmarks/replay_env.py's env since a0bbd33)")
    cols = ["name", "at", "pinned", "table", *NUMERIC[:-2], "decode_affinity", "decode_ran_on",
            "prefill_ran_on"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r[c]) for c in cols) + " |")
    corr = correlations(rows)
    for target, by in corr.items():
        print(f"correlation with {target} over {len(rows)} replays: "
              + ", ".join(f"{c} {fmt(v)}" for c, v in by.items()))
    if args.json:
        print(json.dumps({"rows": rows, "correlations": corr}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
