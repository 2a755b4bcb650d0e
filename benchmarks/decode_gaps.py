r"""Where the time between two tokens goes on the live disaggregated decode path (issue 11 part 3).

    flock /tmp/kvcake_bench.lock .venv/bin/python benchmarks/decode_gaps.py --rate 0.197 --num-requests 15
    flock /tmp/kvcake_bench.lock .venv/bin/python benchmarks/decode_gaps.py --rate 0.787 --json
    flock /tmp/kvcake_bench.lock .venv/bin/python benchmarks/decode_gaps.py --rate 1.113 \
        --num-requests 40 --systems disagg,colocated --pin both

The regime's first --num-requests requests (`serving_disagg_vs_colocated.py`'s regime.json in
--out-dir, seeded Poisson arrivals at --rate) replayed once through 1P+1D (its `Served("disagg")`)
with the decode worker's step trace on (`$KVCAKE_STEP_TRACE`, kvcake/engine/step_trace.py:
every engine step's start, end, end of sending its tokens, CPU time and rows). Printed: the
decode batch, the engine step's wall and CPU time (per batch size too), the loop's time between
two steps, the sending of a step's tokens, and the paper's per-request TBT (mean of the slowest
10% of a request's gaps) as the worker sent the tokens vs as the replay client received them:
what the frontend, its SSE and the client add to the step. `--systems disagg,colocated` replays
the same requests through the 2 colocated workers too (budget `--colocated-budget`; both
workers' step trace: each step's decode rows and prompt chunks, benchmarks/colocated_terms.py's
factors per step kind with the other worker idle / stepping, given `--decode-fit` and the
`prefill_refit.json` beside it), and `--pin both` runs each system with `pin_workers` off,
then on (kvcake/server/cluster/cpu_pinning.py). Needs the bench lock (a live run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import colocated_terms  # noqa: E402
import serving_disagg_vs_colocated as cap  # noqa: E402
from replay_env import worker_roles  # noqa: E402

from kvcake.bench.stats import paper_tbt_s  # noqa: E402
from kvcake.engine.step_trace import ENV  # noqa: E402


def pct(values: list[float], *qs: float) -> list[float]:
    return [round(1000 * float(np.percentile(values, q)), 2) for q in qs] if values else []


def analyse(steps: list[dict[str, Any]], client_tbts: list[float]) -> dict[str, Any]:
    steps = sorted(steps, key=lambda s: s["t0"])
    busy = [s for s in steps if s["rows"]]
    wall = [s["t1"] - s["t0"] for s in busy]
    cpu = [s["cpu"] for s in busy]
    by_batch: dict[int, list[float]] = defaultdict(list)
    for s in busy:
        by_batch[len(s["rows"])].append(s["t1"] - s["t0"])
    # the loop's time outside the engine between two consecutive busy steps (not idle waits)
    between = [b["t0"] - a["t2"] for a, b in zip(busy, busy[1:], strict=False)
               if b["t0"] - a["t2"] < 1.0]
    sent: dict[str, list[float]] = defaultdict(list)
    for s in busy:
        for rid, _ in s["rows"]:
            sent[rid].append(s["t2"])
    worker_tbts = [paper_tbt_s(np.diff(t).tolist()) for t in sent.values() if len(t) > 2]
    return {
        "steps": len(busy),
        "batch_mean": round(float(np.mean([len(s["rows"]) for s in busy])), 2) if busy else 0,
        "batch_max": max((len(s["rows"]) for s in busy), default=0),
        "step_wall_ms_p50_p90": pct(wall, 50, 90), "step_cpu_ms_p50_p90": pct(cpu, 50, 90),
        "wall_over_cpu": round(sum(wall) / max(sum(cpu), 1e-9), 3),
        "step_wall_ms_p50_by_batch": {b: pct(v, 50)[0] for b, v in sorted(by_batch.items())},
        "between_steps_ms_p50_p99": pct(between, 50, 99),
        "send_ms_p50_p99": pct([s["t2"] - s["t1"] for s in busy], 50, 99),
        "tbt_ms_p50_p90": {"worker_sent": pct(worker_tbts, 50, 90),
                           "client": pct(client_tbts, 50, 90)},
    }


BUSY_SHARE = 0.25  # of a core: any /proc tick in a 20 ms sample (host_terms.BUSY)


class WorkerCpu:
    """Samples the cluster's worker processes' CPU (utime + stime from /proc) every `period_s`
    on the monotonic clock (the step trace's), from a thread of this process: when the host's
    prefill worker computed, next to the decode worker's steps. The workers are the `kvcake
    worker ... --role R` processes whose `--parent-pid` is the server (its session leader; each
    worker starts a session of its own); sampled by role."""

    def __init__(self, session: int, period_s: float = 0.02) -> None:
        self.session, self.period_s = session, period_s
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def roles(self) -> dict[int, str]:
        return worker_roles(self.session)  # pid -> role of the server's worker processes

    def _cpu_s(self, pid: int) -> float:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) * self.tick_s

    def _run(self) -> None:
        pids = self.roles()
        while not self._stop.wait(self.period_s):
            now, cpu = time.monotonic(), dict[str, float]()
            for pid, role in pids.items():
                try:
                    cpu[role] = cpu.get(role, 0.0) + self._cpu_s(pid)
                except (OSError, ValueError):
                    pass
            self.samples.append((now, cpu))

    def __enter__(self) -> WorkerCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def share(self, role: str, t0: float, t1: float) -> float | None:
        """The role's mean CPU (cores) over [t0, t1], from the samples around it (None: no
        samples span it)."""
        before = [(t, c[role]) for t, c in self.samples if t <= t0 and role in c]
        after = [(t, c[role]) for t, c in self.samples if t >= t1 and role in c]
        if not before or not after:
            return None
        (ta, ca), (tb, cb) = before[-1], after[0]
        return (cb - ca) / max(tb - ta, 1e-9)


def contention_by_prefill(steps: list[dict[str, Any]], cpu: WorkerCpu,
                          decode_fit: Any | None) -> dict[str, Any]:
    """The decode steps split by whether the host's prefill worker computed over them (its CPU
    at BUSY_SHARE of a core or more): per class the steps, their wall / CPU and, with the isolated
    1-thread step fit (`decode_refit.json`), their wall / fit: the measured decode contention
    while the prefill worker computes and while it does not (what `live.contention`'s
    `decode_prefill_busy` / `decode` say in kvcake/sim/live_profile.py)."""
    out: dict[str, Any] = {}
    classes: dict[str, list[dict[str, Any]]] = {"prefill_busy": [], "prefill_idle": []}
    for s in steps:
        if not s["rows"]:
            continue
        share = cpu.share("prefill", s["t0"], s["t1"])
        if share is None:
            continue
        classes["prefill_busy" if share >= BUSY_SHARE else "prefill_idle"].append(s)
    for name, group in classes.items():
        if not group:
            continue
        wall = sum(s["t1"] - s["t0"] for s in group)
        cpu_s = sum(s["cpu"] for s in group)
        row: dict[str, Any] = {"steps": len(group),
                               "wall_over_cpu": round(wall / max(1e-9, cpu_s), 3)}
        if decode_fit is not None:
            fit = sum(decode_fit.decode_step_time_s(len(s["rows"]), sum(n for _, n in s["rows"]))
                      for s in group)
            row["wall_over_fit"] = round(wall / max(fit, 1e-9), 3)
            row["cpu_over_fit"] = round(cpu_s / max(fit, 1e-9), 3)
        out[name] = row
    busy = [s for s in steps if s["rows"]]
    overhead = [b["t0"] - a["t1"] for a, b in zip(busy, busy[1:], strict=False)
                if b["t0"] - a["t1"] < 0.05]  # send + loop, back-to-back steps only
    out["per_step_overhead_ms_mean_p50"] = ([round(1000 * float(np.mean(overhead)), 3),
                                             round(1000 * float(np.median(overhead)), 3)]
                                            if overhead else None)
    return out


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def replay_one(kind: str, pin: bool, cap_args: Any, regime: Any, planned: list[Any],
               rate: float, budget: int | None, decode_fit: Any | None = None,
               save: Path | None = None, prefill_fit: Any | None = None) -> dict[str, Any]:
    """One replay of `planned` through a fresh `kind` cluster (pin_workers = `pin`)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvcake-steps-") as trace_dir:
        os.environ[ENV] = trace_dir  # the server and its workers inherit it
        try:
            served = cap.Served(kind, cap_args, regime, budget, pin=pin)
            if port_in_use(served.port):  # a stale server would answer the health check
                raise SystemExit(f"127.0.0.1:{served.port} is in use: stop what listens "
                                 f"there (an earlier run's server?) or pass another port")
            with served:
                assert served.server is not None and served.server.sid is not None
                with WorkerCpu(served.server.sid) as cpu:
                    begun = time.monotonic()
                    results, duration = served.replay(planned)
        finally:
            del os.environ[ENV]
        steps = [{**json.loads(line), "worker": path.stem.split("-", 1)[1]}
                 for path in sorted(Path(trace_dir).glob("steps-*.jsonl"))
                 for line in path.read_text().splitlines()]
    steps = [s for s in steps if s["t0"] >= begun]  # the replay's, not the warm-up's
    client = [paper_tbt_s(r.gaps_s) for r in results if r.gaps_s]
    summary = cap.probe_summary(results, duration, regime, rate)
    report = {"system": kind, "pin_workers": pin, "started": started, "load_before": load,
              "load_after": os.getloadavg(), "requests": len(planned),
              "completed": summary["completed"], "failed": summary["failed"],
              "shares": [round(x, 3) for x in summary["shares"]],
              "ttft_ms_p50_p90": [round(summary["median_ttft_ms"], 1),
                                  round(summary["p90_ttft_ms"], 1)],
              "client_tbt_ms_p50_p90": pct(client, 50, 90)}
    if steps and kind == "colocated":  # both workers' mixed steps (decode rows + chunks)
        report["colocated_steps"] = colocated_terms.summary(
            [{**s, "t0": s["t0"] - begun, "t1": s["t1"] - begun, "t2": s["t2"] - begun}
             for s in steps], decode_fit, prefill_fit)
    elif steps:  # the decode worker's step trace
        report.update(analyse(steps, client))
        report["contention"] = contention_by_prefill(steps, cpu, decode_fit)
    if save is not None:  # the raw series, times from the replay's start (the planned offsets')
        save.write_text(json.dumps({
            "report": report, "rate": rate, "begun": begun,
            "steps": [{**x, "t0": x["t0"] - begun, "t1": x["t1"] - begun, "t2": x["t2"] - begun}
                      for x in sorted(steps, key=lambda x: x["t0"])],
            "cpu": [[t - begun, c] for t, c in cpu.samples],
            "requests": [{"send_at_s": p.send_at_s, "prompt_len": len(p.prompt_token_ids),
                          "max_tokens": p.max_tokens, "outcome": r.outcome.value,
                          "ttft_s": r.ttft_s,
                          "gaps_s": list(r.gaps_s)} for p, r in zip(planned, results,
                                                                    strict=True)]}) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/kvcake-capacity"))
    p.add_argument("--rate", type=float, default=0.197, help="requests per second")
    p.add_argument("--num-requests", type=int, default=15)
    p.add_argument("--seed", type=int, default=7, help="prompt tokens of the replay")
    p.add_argument("--systems", default="disagg",
                   help="comma-separated, of disagg and colocated (the capacity run's shapes)")
    p.add_argument("--pin", choices=("on", "off", "both"), default="on",
                   help="pin_workers of the clusters; both: an off/on A/B per system")
    p.add_argument("--colocated-budget", type=int, default=None,
                   help="the colocated workers' prefill-chunk budget (default: --out-dir's "
                        "colocated-budget.json, else 64)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--decode-fit", type=Path, default=None, metavar="JSON",
                   help="a decode step fit (sim_vs_live.py's decode_refit.json): each step's "
                        "wall over the isolated fit, with the prefill worker busy and idle")
    p.add_argument("--save", type=Path, default=None, metavar="PREFIX",
                   help="write each replay's raw series (steps, workers' CPU samples, requests) "
                        "to PREFIX-<system>-pin<on|off>.json (for sim_vs_live.py --batch-series)")
    args = p.parse_args(argv)
    decode_fit = prefill_fit = None
    if args.decode_fit is not None:
        from kvcake.conductor import DecodeStepPredictor, PrefillTimePredictor
        decode_fit = DecodeStepPredictor.from_json(
            json.dumps(json.loads(args.decode_fit.read_text())["decode"]))
        refit = args.decode_fit.parent / "prefill_refit.json"  # sim_vs_live --refit-prefill
        if refit.is_file():
            prefill_fit = PrefillTimePredictor.from_json(
                json.dumps(json.loads(refit.read_text())["prefill"]))
    cap_args = cap.parse_args(["--out-dir", str(args.out_dir)])
    regime = cap.load_regime(cap_args)
    cap_args.vocab_size = cap.prepare_model(cap_args).vocab_size
    records = cap.records_of(cap_args.trace, regime.num_requests)
    planned = cap.workload(records, regime, cap_args.vocab_size, args.rate,
                           args.seed)[:args.num_requests]
    pins = {"on": [True], "off": [False], "both": [False, True]}[args.pin]
    if args.colocated_budget is None:
        chosen = args.out_dir / "colocated-budget.json"
        args.colocated_budget = (int(json.loads(chosen.read_text())["chunk_budget"])
                                 if chosen.is_file() else 64)
    reports = []
    for kind in args.systems.split(","):
        if kind not in ("disagg", "colocated"):
            raise SystemExit(f"--systems: disagg or colocated, got {kind!r}")
        for pin in pins:
            budget = args.colocated_budget if kind == "colocated" else None
            save = (None if args.save is None else
                    Path(f"{args.save}-{kind}-pin{'on' if pin else 'off'}.json"))
            report = {"rate": args.rate, **replay_one(kind, pin, cap_args, regime, planned,
                                                      args.rate, budget, decode_fit, save,
                                                      prefill_fit)}
            reports.append(report)
            for key, value in report.items():
                print(f"{key}: {json.dumps(value)}")
            print(flush=True)
    if args.json:
        print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
