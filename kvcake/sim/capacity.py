"""Effective request capacity vs TBT threshold: MOONCAKE against colocated vLLM-like baselines.

The paper's Figures 1, 6, 7 (capacity) and 8 (prefill GPU time). Same hardware budget for all:
MOONCAKE is 8 prefill + 8 decode nodes running `global_cache`; each baseline runs all 16 nodes
colocated (prefill and decode on every node): plain vLLM (no prefix cache), vLLM prefix caching
(an HBM prefix cache per node, cache-affine routing), and vLLM chunked prefill (no prefix cache;
chunks piggy-back on decode steps under a token budget).

Capacity as the paper measures it: for each system and TBT threshold, the highest load (replay
speed) at which at least 90% of all requests meet both SLOs, found by search
(`kvcake.bench.capacity.find_capacity`: doubling, then geometric bisection to within 5%); the
gain is the ratio of those speeds. The share of effective requests at the base speed is kept as
a second table. A baseline never rejects, so one run at a speed serves every threshold (runs are
remembered by speed); MOONCAKE rejects by the TBT SLO it is given, so it runs per threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcake.bench.capacity import CapacityResult, find_capacity
from kvcake.sim import paper
from kvcake.sim.plots import plot_lines

if TYPE_CHECKING:
    from kvcake.sim.reproduce import Context
    from kvcake.sim.run import SimResult

THRESHOLDS_MS = (100, 200, 300)
TARGET_SHARE = 0.9  # the paper: >= 90% of requests within both SLOs
SEARCH_REL_TOL = 0.05
SEARCH_MAX_PROBES = 9
BASELINES: dict[str, dict[str, Any]] = {
    "vllm": {"policy": "colocated", "prefix_cache": False},
    "vllm_prefix_caching": {"policy": "colocated", "prefix_cache": True},
    "vllm_chunked_prefill": {"policy": "colocated", "prefix_cache": False,
                             "chunked_prefill": True},
}
SYSTEMS: dict[str, dict[str, Any]] = {"mooncake": {"policy": "global_cache"}, **BASELINES}


def _runs_for(ctx: Context, system: str, ms: int) -> dict[str, Any]:
    """The changes of one system's run at threshold `ms` (MOONCAKE admits by it)."""
    changes = dict(SYSTEMS[system])
    if system == "mooncake":
        changes["tbt_slo_ms"] = float(ms)
    return changes


class _Runs:
    """Simulated runs remembered by (system, threshold it admits by, speed)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._done: dict[tuple[str, float, float], SimResult] = {}

    def result(self, system: str, ms: int, speed: float) -> SimResult:
        admits_by = float(ms) if system == "mooncake" else 0.0
        key = (system, admits_by, round(speed, 9))
        if key not in self._done:
            self._done[key] = self.ctx.sim(speed=speed, **_runs_for(self.ctx, system, ms))
        return self._done[key]

    def share(self, system: str, ms: int, speed: float) -> float:
        from kvcake.sim.reproduce import effective_share

        return effective_share(self.result(system, ms, speed), self.ctx.base.ttft_slo_s,
                               ms / 1000.0)


def search_capacity(ctx: Context, runs: _Runs | None = None, rel_tol: float = SEARCH_REL_TOL,
                    max_probes: int = SEARCH_MAX_PROBES) -> dict[str, list[CapacityResult]]:
    """Per system, per threshold: the capacity search's result."""
    runs = runs or _Runs(ctx)
    found: dict[str, list[CapacityResult]] = {}
    for system in SYSTEMS:
        found[system] = [
            find_capacity(lambda speed, s=system, ms=ms: runs.share(s, ms, speed),  # type: ignore[misc]
                          ctx.base.speed, TARGET_SHARE, max_probes, rel_tol)
            for ms in THRESHOLDS_MS]
    return found


def gains(caps: dict[str, list[float]]) -> list[float | None]:
    """MOONCAKE's capacity over the best baseline's, minus 1, per threshold (None: no baseline
    reaches the target at any speed tried)."""
    out: list[float | None] = []
    for i in range(len(THRESHOLDS_MS)):
        best = max(caps[b][i] for b in BASELINES)
        out.append(caps["mooncake"][i] / best - 1 if best > 0 else None)
    return out


def capacity(ctx: Context) -> list[str]:
    runs = _Runs(ctx)
    base_speed = ctx.base.speed
    slo = ctx.base.ttft_slo_s
    # The fixed-speed tables: the share of effective requests at the base speed.
    shares = {s: [runs.share(s, ms, base_speed) for ms in THRESHOLDS_MS] for s in SYSTEMS}
    at_base = {s: runs.result(s, THRESHOLDS_MS[0], base_speed).summary for s in SYSTEMS}
    compute = {s: at_base[s]["prefill_compute_s"] for s in SYSTEMS}
    found = search_capacity(ctx, runs)
    caps = {s: [r.best_speed or 0.0 for r in found[s]] for s in SYSTEMS}
    gain = gains(caps)
    workload = ctx.workload or ""
    paper_gain = paper.CAPACITY_GAIN.get(workload, {})
    paper_time = paper.PREFILL_TIME_RATIO.get(workload, {})
    # `--json`: exactly these keys (capacities are replay speeds; gains are fractions).
    ctx.data.update({"tbt_slo_ms": list(THRESHOLDS_MS), "systems": caps,
                     "gain_vs_best_baseline": gain})

    lines = ctx.header("Effective request capacity vs TBT threshold (MOONCAKE vs colocated vLLM)")
    lines += ["Same 16 nodes: MOONCAKE = 8 prefill + 8 decode (global_cache, early rejection); "
              "baselines = 16 colocated instances, never rejecting.", "",
              f"**Share of effective requests at speed {base_speed:g}** (the fixed-speed "
              "table):", "",
              "| system | " + " | ".join(f"TBT {ms} ms" for ms in THRESHOLDS_MS)
              + " | mean TTFT (s) | mean TBT (ms) | prefill GPU time (s) | x MOONCAKE's |",
              "|---" * (len(THRESHOLDS_MS) + 5) + "|"]
    for system, values in shares.items():
        s = at_base[system]
        ratio = compute[system] / compute["mooncake"]
        lines.append(f"| {system} | " + " | ".join(f"{v:.3f}" for v in values)
                     + f" | {s['ttft_s']['mean']:.3g} | {1000 * s['tbt_s']['mean']:.3g} | "
                     f"{compute[system]:,.0f} | {ratio:.2f} |")
    lines += ["", f"**Capacity** (the paper's measure): the highest replay speed at which at least "
              f"{TARGET_SHARE:.0%} of all requests meet TTFT <= {slo:g} s and the TBT threshold, "
              f"found by search (doubling from speed {base_speed:g}, then geometric bisection to "
              f"within {SEARCH_REL_TOL:.0%}; every probe is a full simulation; 0 = not reached "
              "even at the slowest speed tried).", "",
              "| capacity (highest speed) of | " + " | ".join(f"TBT {ms} ms" for ms in THRESHOLDS_MS)
              + " |", "|---" * (len(THRESHOLDS_MS) + 1) + "|"]
    for system, values in caps.items():
        lines.append(f"| {system} | " + " | ".join(f"{v:.3g}x" for v in values) + " |")
    lines += ["", "| TBT threshold | our capacity gain over the best baseline | paper's gain |",
              "|---|---|---|"]
    for ms, g in zip(THRESHOLDS_MS, gain, strict=True):
        theirs = f"+{paper_gain[ms]:.0%}" if ms in paper_gain else "n/a"
        lines.append(f"| {ms} ms | {'n/a' if g is None else f'{g:+.0%}'} | {theirs} |")
    if paper_time:
        lines += ["", "Prefill GPU time as a multiple of MOONCAKE's (paper Figure 8): "
                  + ", ".join(f"{b} ours {compute[b] / compute['mooncake']:.2f}x vs paper "
                              f"{paper_time[b]:.2f}x" for b in BASELINES) + "."]
    lines.append("")
    xs = [float(ms) for ms in THRESHOLDS_MS]
    plot_lines(ctx.out / f"capacity_{ctx.stem}.png", f"Effective request capacity, {ctx.stem}",
               [("TBT threshold (ms)", "capacity (highest replay speed, >= 90% effective)",
                 {name: (xs, values) for name, values in caps.items()}),
                ("TBT threshold (ms)", f"share effective at speed {base_speed:g}",
                 {name: (xs, values) for name, values in shares.items()})])
    return lines
