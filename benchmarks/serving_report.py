"""The tables `benchmarks/serving_vs_vllm.py` prints: one column per system with the median
over repeats and its range, ours / vLLM ratios, each repeat's ratios (`--json-summary`'s
`summary_ratios`), the position effect of the alternating orders, and the TTFT sweep.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvcake.bench.repeats import position_effect, ratios, spread

ROWS = (("startup_s", "server start to healthy (s)"),
        ("probe.ttft_cold_ms", "probe TTFT cold (ms)"),
        ("probe.ttft_repeat_ms", "probe TTFT repeat (ms)"),
        ("probe.mean_tbt_ms", "probe mean TBT (ms)"),
        ("probe.e2e_cold_ms", "probe e2e cold (ms)"),
        ("probe.hit_tokens_repeat", "probe hit tokens, repeat"),
        ("trace.median_ttft_ms", "trace TTFT p50 (ms)"),
        ("trace.p90_ttft_ms", "trace TTFT p90 (ms)"),
        ("trace.median_tbt_ms", "trace TBT p50 (ms)"),
        ("trace.p90_tbt_ms", "trace TBT p90 (ms)"),
        ("trace.median_itl_ms", "trace ITL p50 (ms)"),
        ("trace.output_throughput", "trace output tok/s"),
        ("trace.hit_tokens", "trace hit tokens"),
        ("trace.effective_request_capacity", "trace share meeting SLOs"))



def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"



def peer_and_ours(names: list[str]) -> tuple[str | None, list[str]]:
    """The first vLLM column (the base of every ratio) and the other columns."""
    return (next((n for n in names if n.startswith("vllm")), None),
            [n for n in names if not n.startswith("vllm")])



def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Per system the median over its runs (with min-max when there are several) and ours / vLLM
    of the medians."""
    names = list(runs)
    peer, ours = peer_and_ours(names)
    ratio_cols = [f"{n.removeprefix('kvcake-')} / {peer}" for n in ours] if peer else []
    print(f"| metric | {' | '.join(names)} | {' | '.join(ratio_cols)} |".replace(" |  |", " |"))
    print("|---" * (1 + len(names) + len(ratio_cols)) + "|")
    for path, label in ROWS:
        spreads = [spread(runs[n], path) for n in names]
        if all(v is None for v in spreads):
            continue
        cells = ["-" if v is None else fmt(v.median) if v.n == 1 else
                 f"{fmt(v.median)} ({fmt(v.low)}-{fmt(v.high)})" for v in spreads]
        if peer is not None:
            base = spread(runs[peer], path)
            for n in ours:
                v = spread(runs[n], path)
                cells.append("-" if v is None or base is None or not base.median
                             else f"{v.median / base.median:.2f}")
        print(f"| {label} | {' | '.join(cells)} |")

SUMMARY = (("probe_ttft_cold", "probe.ttft_cold_ms"), ("probe_mean_tbt", "probe.mean_tbt_ms"),
           ("trace_ttft_p50", "trace.median_ttft_ms"), ("trace_ttft_p90", "trace.p90_ttft_ms"),
           ("trace_tbt_p50", "trace.median_tbt_ms"), ("trace_tbt_p90", "trace.p90_tbt_ms"))

MEDIAN_PATHS = tuple(path for path, _ in ROWS)



def summary_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """ours / vLLM per summary metric: the first kvcake and the first vLLM column."""
    peer, ours = peer_and_ours(list(results))
    return ratios(results[ours[0]] if ours else None, results[peer] if peer else None, SUMMARY)



def print_sweep(runs: dict[str, list[dict[str, Any]]]) -> None:
    """`--ttft-sweep`: per length and system the medians over repeats of each sweep figure."""
    names = [n for n in runs if all("ttft_sweep" in r for r in runs[n])]
    if not names:
        return
    print("| prompt len | system | " + " | ".join(("client TTFT", "server TTFT", "server queue",
                                                   "server prefill", "server CPU")) +
          " (ms) | server cores |")
    print("|---" * 8 + "|")
    keys = ("client_ttft_ms", "server_time_to_first_token_ms", "server_request_queue_time_ms",
            "server_request_prefill_time_ms", "server_cpu_ms", "server_cores")
    for length in runs[names[0]][0]["ttft_sweep"]:
        for n in names:
            cells = []
            for k in keys:
                vs = [r["ttft_sweep"][length].get(k) for r in runs[n]]
                vs = [v for v in vs if v is not None]
                cells.append(fmt(statistics.median(vs)) if vs else "-")
            print(f"| {length} | {n} | {' | '.join(cells)} |")



def print_positions(runs: list[dict[str, Any]], labels: list[str]) -> None:
    """Each system's medians when it ran first and when it ran second (alternating orders)."""
    print("| system | metric | ran first | ran second | second / first |")
    print("|---|---|---|---|---|")
    for label in labels:
        for key, path in SUMMARY:
            pos = position_effect(runs, label, path)
            if 0 in pos and 1 in pos:
                change = f"{pos[1] / pos[0]:.2f}" if pos[0] else "-"
                print(f"| {label} | {key} | {fmt(pos[0])} | {fmt(pos[1])} | {change} |")



def print_runs(runs: list[dict[str, Any]]) -> None:
    """One line per repeat: its order, that repeat's summary ratios, each system's host state
    before it started, the CPU busy and steal shares while it was measured (the same work busies
    the host about as much every time: a share well above the system's others is someone else's
    work) and how long its teardown took after the stop returned."""
    keys = [k for k, _ in SUMMARY]
    print(f"| repeat | order | {' | '.join(keys)} | host before each (busy, MiB free, spin ms) "
          f"| while measured (CPU busy, steal) | teardown after stop (s, procs left) |")
    print("|---" * (5 + len(keys)) + "|")
    for run in runs:
        rs = run["ratios"]
        host = "; ".join(f"{n}: {r['host_before']['cpu_busy']}, "
                         f"{r['host_before']['mem_available_mib']:.0f}, "
                         f"{r['host_before']['spin_ms']}" for n, r in run["results"].items())
        steal = "; ".join(f"{n}: {fmt(r.get('host_during', {}).get('cpu_busy'))}, "
                          f"{fmt(r.get('host_during', {}).get('steal'))}"
                          for n, r in run["results"].items())
        down = "; ".join(f"{n}: -" if r.get("teardown") is None else
                         f"{n}: {r['teardown']['wait_s']:.2f}, {r['teardown']['left_at_start']}"
                         for n, r in run["results"].items())
        print(f"| {run['repeat']} | {' > '.join(run['order'])} | "
              f"{' | '.join(fmt(rs[k]) for k in keys)} | {host} | {steal} | {down} |")
