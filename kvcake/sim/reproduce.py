"""`kvcake reproduce`: rerun one of the paper's experiments and write a report beside its numbers.

Each experiment runs the simulator (or, for Figure 9, a trace replay) over one trace, then
writes `<experiment>_<trace>.md` (our numbers, the paper's, the assumptions and the gap) and
`<experiment>_<trace>.png` into the output directory. Every policy of one report runs with the
same load, profile and seed; nothing is tuned per policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Any

from kvcake.sim import paper
from kvcake.sim.config import SimConfig
from kvcake.sim.hitrate import lru_hit_rate
from kvcake.sim.plots import plot_bars, plot_lines
from kvcake.sim.records import is_effective
from kvcake.sim.run import SimResult, simulate
from kvcake.sim.trace import Trace, load_trace

POLICIES4 = ("random", "load_balance", "local_cache", "global_cache")


@dataclass
class Context:
    """What every experiment gets: the trace, the base config and where to write."""

    trace: Trace
    trace_path: Path
    base: SimConfig
    out: Path
    command: str
    workload: str | None
    runs: int = 0
    started_s: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)  # the numbers, for `--json`

    @property
    def stem(self) -> str:
        """File-name part: the trace's name, and the speed when it is not the trace's own."""
        b = self.base
        speed = "" if b.speed == 1.0 else f"_speed{b.speed:g}"
        ttft = "" if b.ttft_slo_s == SimConfig.ttft_slo_s else f"_ttft{b.ttft_slo_s:g}s"
        cpp = "" if b.cpp_min_tokens is None else f"_cpp{b.cpp_nodes}"
        handoff = ("_reselect" if b.decode_reselect_at_handoff else "") + (
            "_keepnode" if b.decode_check_keeps_node else "")
        return self.trace_path.stem.replace("_trace", "") + speed + ttft + cpp + handoff

    def sim(self, **changes: Any) -> SimResult:
        self.runs += 1
        return simulate(replace(self.base, **changes), self.trace)

    def header(self, title: str) -> list[str]:
        b = self.base
        return [
            f"# {title} on `{self.trace_path.name}`", "",
            f"Command: `{self.command}`  ",
            f"Date: {date.today().isoformat()} (UTC); written by `kvcake reproduce`.", "",
            "Set-up shared by every run below: profile `" + b.profile + "` (cost model of "
            "`kvcake/conductor/cost.py`), " + f"speed {b.speed:g} (arrival times divided by it), "
            f"seed {b.seed}, TTFT SLO {b.ttft_slo_s:g} s, TBT SLO {b.tbt_slo_ms:g} ms unless a "
            f"column says otherwise, {len(self.trace)} requests"
            + ("" if b.max_requests is None else f" (first {b.max_requests} simulated)") + ".", "",
        ]


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


# ---- Figure 5: average TTFT of the four scheduling policies ------------------------------------

def figure5(ctx: Context) -> list[str]:
    speeds = sorted({ctx.base.speed, 1.0, 1.25, 1.5})
    table: dict[float, dict[str, dict[str, Any]]] = {}
    for speed in speeds:
        table[speed] = {p: ctx.sim(policy=p, speed=speed, num_prefill=8, num_decode=8).summary
                        for p in POLICIES4}
    main = table[ctx.base.speed]
    lines = ctx.header("Figure 5: average TTFT by scheduling policy (8 prefill + 8 decode)")
    lines += ["| policy | our mean TTFT (s) | p50 | p90 | rejected | cache hit rate | "
              "paper mean TTFT (s) |", "|---|---|---|---|---|---|---|"]
    for p in POLICIES4:
        s = main[p]
        paper_ttft = paper.FIGURE5_TTFT_S[p] if ctx.workload == "conversation" else None
        lines.append(f"| {p} | {_fmt(s['ttft_s']['mean'])} | {_fmt(s['ttft_s']['p50'])} | "
                     f"{_fmt(s['ttft_s']['p90'])} | {s['rejected']} | "
                     f"{_fmt(s['cache_hit_rate'])} | {paper_ttft or 'n/a'} |")
    lines += ["", "Load sensitivity (mean TTFT in s; global vs local in the last column):", "",
              "| speed | " + " | ".join(POLICIES4) + " | global / local |",
              "|---" * (len(POLICIES4) + 2) + "|"]
    for speed in speeds:
        row = table[speed]
        ratio = row["global_cache"]["ttft_s"]["mean"] / row["local_cache"]["ttft_s"]["mean"]
        lines.append(f"| {speed:g} | " + " | ".join(_fmt(row[p]["ttft_s"]["mean"])
                                                     for p in POLICIES4) + f" | {ratio:.3f} |")
    g, loc = main["global_cache"]["ttft_s"]["mean"], main["local_cache"]["ttft_s"]["mean"]
    order = [main[p]["ttft_s"]["mean"] for p in POLICIES4]
    lines += ["", f"Paper: {paper.FIGURE5_CLAIM}. Ours at speed {ctx.base.speed:g}: "
              f"global_cache is {100 * (1 - g / loc):.1f}% below local_cache; the order "
              f"random > load_balance > local_cache > global_cache "
              f"{'holds' if order == sorted(order, reverse=True) else 'does NOT hold'}.", ""]
    ctx.data.update({"speed": ctx.base.speed, "policies": {p: {
        "mean_ttft_s": main[p]["ttft_s"]["mean"], "rejected": main[p]["rejected"],
        "cache_hit_rate": main[p]["cache_hit_rate"]} for p in POLICIES4},
        "mean_ttft_s_by_speed": {f"{sp:g}": {p: table[sp][p]["ttft_s"]["mean"] for p in POLICIES4}
                                 for sp in speeds}})
    series = {"ours": order}
    if ctx.workload == "conversation":
        series["paper"] = [paper.FIGURE5_TTFT_S[p] for p in POLICIES4]
    plot_bars(ctx.out / f"figure5_{ctx.stem}.png", f"Figure 5: mean TTFT, {ctx.stem}",
              list(POLICIES4), series, "mean TTFT (s)")
    return lines


# ---- Figure 9: hit rate vs cache capacity ------------------------------------------------------

FIGURE9_CAPACITIES = (1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000, 20_000_000,
                      50_000_000, 100_000_000)


def figure9(ctx: Context) -> list[str]:
    trace = ctx.trace if ctx.base.max_requests is None else \
        ctx.trace.sampled(first=ctx.base.max_requests)
    best = lru_hit_rate(trace, None)
    rates = [lru_hit_rate(trace, c) for c in FIGURE9_CAPACITIES]
    lines = ctx.header("Figure 9: cache hit rate vs cache capacity (one LRU prefix cache)")
    lines += ["Trace replay, no timing: each request reuses the longest run of its leading blocks "
              "found in one shared LRU cache of the given size.", "",
              "| capacity (tokens) | hit rate | share of the maximum |", "|---|---|---|"]
    for cap, rate in zip(FIGURE9_CAPACITIES, rates, strict=True):
        lines.append(f"| {cap / 1e6:g}M | {rate:.3f} | {rate / best if best else 0:.2f} |")
    lines.append(f"| unlimited | {best:.3f} | 1.00 |")
    r3, r50 = rates[FIGURE9_CAPACITIES.index(3_000_000)], rates[FIGURE9_CAPACITIES.index(50_000_000)]
    ctx.data.update({"capacity_tokens": list(FIGURE9_CAPACITIES), "hit_rate": rates,
                     "max_hit_rate": best})
    lines += ["", f"Paper: {paper.FIGURE9_CLAIM}.", f"Ours: 3M tokens reach {r3 / best:.0%} of the "
              f"maximum ({'under' if r3 < best / 2 else 'NOT under'} half); 50M reach "
              f"{r50 / best:.0%}.", ""]
    plot_lines(ctx.out / f"figure9_{ctx.stem}.png", f"Figure 9: hit rate vs capacity, {ctx.stem}",
               [("cache capacity (tokens)", "hit rate",
                 {"LRU": ([float(c) for c in FIGURE9_CAPACITIES], rates),
                  "unlimited": ([float(c) for c in FIGURE9_CAPACITIES], [best] * len(rates))})],
               logx=True)
    return lines


# ---- Figure 10: global vs local cache ----------------------------------------------------------

FIGURE10_LOCAL_TOKENS = (1_000_000, 3_000_000)


def figure10(ctx: Context) -> list[str]:
    lines = ctx.header("Figure 10: global vs local cache (hit rate and prefill GPU time)")
    lines += ["| local cache per prefill node | policy | hit rate | prefill GPU time (s) | "
              "global/local hit rate | global/local prefill time |", "|---|---|---|---|---|---|"]
    hits: dict[str, list[float]] = {"local_cache": [], "global_cache": []}
    compute: dict[str, list[float]] = {"local_cache": [], "global_cache": []}
    for tokens in FIGURE10_LOCAL_TOKENS:
        res = {p: ctx.sim(policy=p, local_cache_tokens=tokens).summary
               for p in ("local_cache", "global_cache")}
        hr = res["global_cache"]["cache_hit_rate"] / max(1e-12, res["local_cache"]["cache_hit_rate"])
        pr = res["global_cache"]["prefill_compute_s"] / res["local_cache"]["prefill_compute_s"]
        for p in ("local_cache", "global_cache"):
            s = res[p]
            hits[p].append(s["cache_hit_rate"])
            compute[p].append(s["prefill_compute_s"])
            tail = f"{hr:.2f}x | {pr:.2f}x" if p == "global_cache" else " | "
            lines.append(f"| {tokens / 1e6:g}M | {p} | {s['cache_hit_rate']:.3f} | "
                         f"{_fmt(s['prefill_compute_s'])} | {tail} |")
    lines += ["", f"Paper: {paper.FIGURE10_CLAIM}.", ""]
    ctx.data.update({"local_cache_tokens": list(FIGURE10_LOCAL_TOKENS), "cache_hit_rate": hits,
                     "prefill_compute_s": compute})
    plot_bars(ctx.out / f"figure10_{ctx.stem}.png", f"Figure 10: hit rate, {ctx.stem}",
              [f"{t / 1e6:g}M local" for t in FIGURE10_LOCAL_TOKENS], hits, "cache hit rate")
    return lines


# ---- Figure 13: network bandwidth --------------------------------------------------------------

FIGURE13_GBPS = (24, 50, 100, 200, 400, 800)


def figure13(ctx: Context) -> list[str]:
    lines = ctx.header("Figure 13: average TTFT and transfer time vs network bandwidth")
    lines += ["global_cache (fetches planned by Algorithm 1) against local_cache (never fetches: "
              "the recomputation baseline), both with the prefill-to-decode KV hand-off on the "
              "same NICs.", "",
              "| NIC Gbps | global mean TTFT (s) | local mean TTFT (s) | mean fetch time (s) | "
              "mean KV hand-off wait (s) | fetched tokens | global mean TBT (ms) | "
              "global effective capacity |", "|---|---|---|---|---|---|---|---|"]
    ttft_g, ttft_l, fetch = [], [], []
    for gbps in FIGURE13_GBPS:
        g = ctx.sim(policy="global_cache", nic_gbps=float(gbps))
        loc = ctx.sim(policy="local_cache", nic_gbps=float(gbps)).summary
        fetched = [s.fetch_s for s in g.states if s.fetched_len > 0 and s.finish_s is not None]
        waits = [s.kv_wait_s for s in g.states if s.finish_s is not None]
        mean_fetch = sum(fetched) / len(fetched) if fetched else 0.0
        ttft_g.append(g.summary["ttft_s"]["mean"])
        ttft_l.append(loc["ttft_s"]["mean"])
        fetch.append(mean_fetch)
        lines.append(f"| {gbps} | {_fmt(ttft_g[-1])} | {_fmt(ttft_l[-1])} | {_fmt(mean_fetch)} | "
                     f"{_fmt(sum(waits) / max(1, len(waits)))} | {g.summary['fetched_tokens']:,} | "
                     f"{_fmt(1000 * g.summary['tbt_s']['mean'])} | "
                     f"{g.summary['effective_request_capacity']:.3f} |")
    lines += ["", f"Paper: {paper.FIGURE13_CLAIM}.", ""]
    ctx.data.update({"nic_gbps": list(FIGURE13_GBPS), "global_mean_ttft_s": ttft_g,
                     "local_mean_ttft_s": ttft_l, "mean_fetch_s": fetch})
    xs = [float(x) for x in FIGURE13_GBPS]
    plot_lines(ctx.out / f"figure13_{ctx.stem}.png", f"Figure 13: bandwidth, {ctx.stem}",
               [("NIC bandwidth (Gbps)", "mean TTFT (s)",
                 {"global_cache": (xs, ttft_g), "local_cache (recompute)": (xs, ttft_l)}),
                ("NIC bandwidth (Gbps)", "mean fetch time (s)", {"global_cache": (xs, fetch)})],
               logx=True)
    return lines


# ---- Figure 15: prefill:decode ratio -----------------------------------------------------------

FIGURE15_SPLITS = ((5, 11), (6, 10), (7, 9), (8, 8), (9, 7), (10, 6), (11, 5))  # the paper's


def figure15(ctx: Context) -> list[str]:
    from kvcake.bench.capacity import find_capacity

    lines = ctx.header("Figure 15: prefill:decode split of 16 nodes (global_cache)")
    lines += ["Capacity = the highest replay speed at which >= 90% of requests meet both SLOs "
              "(search as in the capacity report, to within 5%).", "",
              "| P:D | effective share | mean TTFT (s) | p90 TTFT (s) | mean TBT (ms) | "
              "p90 TBT (ms) | rejected | capacity (highest speed) |",
              "|---|---|---|---|---|---|---|---|"]
    shares, ttfts, tbts, caps = [], [], [], []
    slo_s, tbt_s = ctx.base.ttft_slo_s, ctx.base.tbt_slo_ms / 1000.0
    for p, d in FIGURE15_SPLITS:
        s = ctx.sim(policy="global_cache", num_prefill=p, num_decode=d).summary
        shares.append(s["effective_request_capacity"])
        ttfts.append(s["ttft_s"]["mean"])
        tbts.append(1000 * s["tbt_s"]["mean"])
        found = find_capacity(
            lambda speed, p=p, d=d: effective_share(  # type: ignore[misc]
                ctx.sim(policy="global_cache", num_prefill=p, num_decode=d, speed=speed),
                slo_s, tbt_s), ctx.base.speed, 0.9, 8, 0.05)
        caps.append(found.best_speed or 0.0)
        lines.append(f"| {p}:{d} | {shares[-1]:.3f} | {_fmt(ttfts[-1])} | "
                     f"{_fmt(s['ttft_s']['p90'])} | {_fmt(tbts[-1])} | "
                     f"{_fmt(1000 * s['tbt_s']['p90'])} | {s['rejected']} | {caps[-1]:.3g}x |")
    best = FIGURE15_SPLITS[max(range(len(shares)), key=shares.__getitem__)]
    best_cap = FIGURE15_SPLITS[max(range(len(caps)), key=caps.__getitem__)]
    lines += ["", f"Paper: {paper.FIGURE15_CLAIM}. Ours: the best split is {best[0]}:{best[1]}"
              f" by the share at speed {ctx.base.speed:g}, {best_cap[0]}:{best_cap[1]} by "
              f"capacity. Mean TBT {min(tbts):.0f}-{max(tbts):.0f} ms across the splits (paper's "
              "Figure 15b: 40-50 ms).", ""]
    ctx.data.update({"splits": [f"{p}:{d}" for p, d in FIGURE15_SPLITS],
                     "effective_share": shares, "capacity": caps, "mean_ttft_s": ttfts,
                     "mean_tbt_ms": tbts})
    xs = [float(p) for p, _ in FIGURE15_SPLITS]
    plot_lines(ctx.out / f"figure15_{ctx.stem}.png", f"Figure 15: P:D split, {ctx.stem}",
               [("prefill nodes (of 16)", "capacity (highest speed)", {"ours": (xs, caps)}),
                ("prefill nodes (of 16)", "mean TTFT (s)", {"ours": (xs, ttfts)}),
                ("prefill nodes (of 16)", "mean TBT (ms)", {"ours": (xs, tbts)})])
    return lines


EXPERIMENTS: dict[str, Callable[[Context], list[str]]] = {
    "figure5": figure5, "figure9": figure9, "figure10": figure10, "figure13": figure13,
    "figure15": figure15,
}


def _register_capacity() -> None:
    from kvcake.sim.capacity import capacity
    from kvcake.sim.overload import overload

    EXPERIMENTS["capacity"] = capacity
    EXPERIMENTS["overload"] = overload
    from kvcake.sim.sensitivity import sensitivity

    EXPERIMENTS["sensitivity"] = sensitivity


_register_capacity()


@dataclass(frozen=True)
class Report:
    """A written report: its markdown file and the experiment's numbers (`--json`)."""

    path: Path
    data: dict[str, Any]


def run_experiment(name: str, trace_path: Path, out: Path,
                   base: SimConfig | None = None) -> Report:
    """Run experiment `name` on the trace from the settings of `base` (the experiment varies
    the rest; default `SimConfig()`: speed, max_requests, profile, seed, SLOs and CPP are what
    `kvcake reproduce` sets); write its markdown and PNG into `out`."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(sorted(EXPERIMENTS))}")
    base = SimConfig() if base is None else base
    trace = load_trace(trace_path)
    out.mkdir(parents=True, exist_ok=True)
    command = _command(name, trace_path, out, base)
    ctx = Context(trace, trace_path, base, out, command, paper.workload_of(trace_path.name))
    ctx.started_s = time.perf_counter()
    lines = EXPERIMENTS[name](ctx)
    elapsed = time.perf_counter() - ctx.started_s
    lines += [f"![{name}]({name}_{ctx.stem}.png)", "",
              f"({ctx.runs} simulated runs, {elapsed:.0f} s wall on the development machine.)", ""]
    path = out / f"{name}_{ctx.stem}.md"
    path.write_text("\n".join(lines))
    return Report(path, ctx.data)


def _command(name: str, trace_path: Path, out: Path, base: SimConfig) -> str:
    """The `kvcake reproduce` command line the report names."""
    return (f"kvcake reproduce {name} --trace {trace_path} --out {out} --speed {base.speed:g}"
            + ("" if base.max_requests is None else f" --max-requests {base.max_requests}")
            + ("" if base.ttft_slo_s == SimConfig.ttft_slo_s else
               f" --ttft-slo-s {base.ttft_slo_s:g}")
            + ("" if base.tbt_slo_ms == SimConfig.tbt_slo_ms else
               f" --tbt-slo-ms {base.tbt_slo_ms:g}")
            + ("" if base.cpp_min_tokens is None else
               f" --cpp-min-tokens {base.cpp_min_tokens} --cpp-nodes {base.cpp_nodes}")
            + (" --decode-reselect-at-handoff" if base.decode_reselect_at_handoff else "")
            + (" --decode-check-keeps-node" if base.decode_check_keeps_node else ""))


def effective_share(result: SimResult, ttft_slo_s: float, tbt_slo_s: float) -> float:
    states = result.states
    return sum(1 for s in states if is_effective(s, ttft_slo_s, tbt_slo_s)) / max(1, len(states))
