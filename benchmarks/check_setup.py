"""What every mode of `benchmarks/sim_vs_live.py` shares: `Setup` (the regime and its requests
at a rate, the colocated budget, the capacity benchmark's arguments, and the live files it
replays: `live_at`), `recorded_replay` (one live replay on a fresh server with what it ran on
recorded) and `Terms` (the live profile with the host terms measured from saved step traces).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import colocated_terms  # noqa: E402
import host_terms  # noqa: E402
import live_replays  # noqa: E402
import replay_env  # noqa: E402
import serving_disagg_vs_colocated as cap  # noqa: E402
from live_replays import live_metrics  # noqa: E402
from simulated_runs import sim_trace  # noqa: E402

from kvcake.bench.prompts import PromptBuilder  # noqa: E402
from kvcake.bench.regime import Regime  # noqa: E402
from kvcake.bench.replay import PlannedRequest  # noqa: E402
from kvcake.bench.stats import RequestResult  # noqa: E402
from kvcake.sim.live_profile import live_cost_from_dict  # noqa: E402
from kvcake.sim.profile_mean import mean_profile  # noqa: E402
from kvcake.sim.trace import Trace, TraceRequest  # noqa: E402


def recorded_replay(system: str, cap_args: Any, regime: Regime, budget: int,
                    planned: list[PlannedRequest],
                    pin: bool) -> tuple[list[RequestResult], dict[str, Any]]:
    """One replay on a fresh `system` server (pin_workers = `pin`) with what could differ
    between invocations recorded (benchmarks/replay_env.py): workers' threads, affinity and
    placement, the GEMM tables and whether they were measured or loaded, /proc/stat, load,
    MHz, and the decode worker's step times from its step trace; and the live Conductor's
    decision for each request (`placements`: kvcake/server/cluster/placement_trace.py's lines,
    in arrival order), to read beside the simulator's."""
    import os
    import tempfile

    from kvcake.engine import cpu_ops
    from kvcake.engine.step_trace import ENV
    from kvcake.server.cluster.placement_trace import ENV as PLACEMENTS

    threads = {"prefill": 1, "decode": 1, "colocated": 1}  # kvcake_toml's num_threads
    env = replay_env.ReplayEnv(cpu_ops.cache_dir(), pin, threads)
    with tempfile.TemporaryDirectory(prefix="kvcake-steps-") as trace_dir:
        os.environ[ENV] = os.environ[PLACEMENTS] = trace_dir  # the server and workers inherit it
        try:
            env.start()
            with cap.Served(system, cap_args, regime, budget if system == "colocated" else None,
                            pin=pin) as served:
                assert served.server is not None and served.server.sid is not None
                env.attach(served.server.sid)
                begun = time.monotonic()
                try:
                    results = served.replay(planned)[0]
                finally:
                    env.stop()
        finally:
            del os.environ[ENV], os.environ[PLACEMENTS]
        placements = [json.loads(line) for path in Path(trace_dir).glob("placements-*.jsonl")
                      for line in path.read_text().splitlines()]
        steps = [json.loads(line) for path in sorted(Path(trace_dir).glob("steps-*.jsonl"))
                 if "decode" in path.stem or system == "colocated"
                 for line in path.read_text().splitlines()]
    report = env.report()
    report["admission"] = cap_args.disagg_admission if system == "disagg" else "none"
    report["prefill_speed_weight"] = cap_args.prefill_speed_weight
    report["decode_steps"] = replay_env.step_split(
        steps, [g for r in results for g in r.gaps_s], begun)
    report["placements"] = sorted(placements, key=lambda line: line["t"])
    return results, report


@dataclass
class Setup:
    """What every mode of a check shares: the regime and its requests, the colocated budget,
    the capacity benchmark's arguments (its model directory and vocabulary)."""

    args: argparse.Namespace
    cap_args: argparse.Namespace
    regime: Regime
    budget: int
    records: list[TraceRequest]
    block_len: int

    @classmethod
    def load(cls, args: argparse.Namespace) -> Setup:
        cap_args = cap.parse_args(["--out-dir", str(args.out_dir),
                                   "--disagg-admission", args.disagg_admission,
                                   "--prefill-speed-weight", str(args.prefill_speed_weight)])
        regime = cap.load_regime(cap_args)
        budget_path = args.out_dir / "colocated-budget.json"
        if not budget_path.is_file():
            raise SystemExit(f"{budget_path} not found: run serving_disagg_vs_colocated.py "
                             "--systems colocated-budget first")
        budget = int(json.loads(budget_path.read_text())["chunk_budget"])
        cap_args.vocab_size = cap.prepare_model(cap_args).vocab_size
        return cls(args, cap_args, regime, budget,
                   cap.records_of(cap_args.trace, regime.num_requests),
                   PromptBuilder(scale_tokens=regime.scale_tokens).block_len)

    def planned(self, rate: float, first: int | None = None) -> list[PlannedRequest]:
        """The regime's requests at `rate` (the first `first` of them), the live replays'."""
        return cap.workload(self.records, self.regime, self.cap_args.vocab_size, rate,
                            self.args.seed)[:first]

    def trace(self, planned: list[PlannedRequest]) -> Trace:
        return sim_trace(self.records[:len(planned)], planned, self.block_len)

    def live_at(self, rate: float, name: str, replay: bool) -> dict[str, Any]:
        """The live metrics at `rate` (benchmarks/live_replays.py replay_file): --live-repeats
        replays of --systems (unless --sim-only), each on a fresh server."""
        args, planned = self.args, self.planned(rate)
        envs: list[dict[str, Any]] = []

        def replay_once(system: str) -> list[RequestResult]:
            results, env = recorded_replay(system, self.cap_args, self.regime, self.budget,
                                           planned, args.pin == "on")
            envs.append(env)
            return results

        target = live_replays.ReplayFile(
            args.out_dir / name, rate, tuple(x for x in args.systems.split(",") if x),
            args.live_repeats, replay=replay and not args.sim_only, append=args.append_replays)
        return live_replays.replay_file(target, replay_once,
                                        lambda rs: live_metrics(rs, self.regime),
                                        extras=lambda: envs.pop())


@dataclass
class Terms:
    """The live profile with the host terms measured from saved step traces (none fitted)."""

    profile: dict[str, Any]
    host: dict[str, Any] | None = None  # --host-terms
    colocated: dict[str, Any] | None = None  # --colocated-terms

    @classmethod
    def measure(cls, args: argparse.Namespace, profile: dict[str, Any]) -> Terms:
        terms = cls(profile)
        if args.host_terms is not None:
            base = live_cost_from_dict(profile)
            terms.host = host_terms.measure(host_terms.load_saved(args.host_terms), base.decode,
                                            base.prefill)
            terms.profile = host_terms.with_terms(terms.profile, terms.host)
            print(f"host terms measured from {args.host_terms}: {json.dumps(terms.host)}")
        if args.colocated_terms is not None:
            base = live_cost_from_dict(terms.profile)
            terms.colocated = colocated_terms.measure(
                host_terms.load_saved(args.colocated_terms), base.decode, base.prefill,
                by_rows=args.colocated_by_rows)
            terms.profile = {**terms.profile, "live": {**terms.profile["live"],
                                                       "colocated": terms.colocated["colocated"]}}
            print(f"colocated terms measured from {args.colocated_terms}: "
                  f"{json.dumps(terms.colocated['colocated'])}")
        return terms

    @classmethod
    def bracketed(cls, before: Terms, after: Terms) -> Terms:
        """The host over a run's stretch: the mean of the profiles and step dispersions
        measured at its two ends (kvcake/sim/profile_mean.py); each end's terms are kept."""
        profile = mean_profile(before.profile, after.profile)
        live = profile["live"]
        terms = cls(profile)
        if before.host is not None and after.host is not None:
            terms.host = {"contention": live["contention"],
                          "decode_step_overhead_s": live["decode_step_overhead_s"],
                          "step_jitter_quantiles": mean_profile(
                              before.host["step_jitter_quantiles"],
                              after.host["step_jitter_quantiles"]),
                          "before": before.host, "after": after.host}
        if before.colocated is not None and after.colocated is not None:
            terms.colocated = {"colocated": live["colocated"],
                               "step_jitter_quantiles": mean_profile(
                                   before.colocated["step_jitter_quantiles"],
                                   after.colocated["step_jitter_quantiles"]),
                               "before": before.colocated, "after": after.colocated}
        return terms

    @property
    def jitters(self) -> dict[str, list[float] | None]:
        """Each system's measured step dispersion (None: its terms were not measured)."""
        return {"disagg": self.host["step_jitter_quantiles"] if self.host else None,
                "colocated": (self.colocated["step_jitter_quantiles"] if self.colocated
                              else None)}

    def cost(self) -> Any:
        return live_cost_from_dict(self.profile).as_cost_model()
