"""The overload report's text and plot: the shared set-up and the offered load against each
pool's capacity (`regime_of`), the rejections table beside the paper's, the mechanism table
(lag, loads, swings, `saved_per_turned_away`) and the pools' loads over time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcake.sim.overload_runs import CHECKED, HERD_WINDOW_S, NUM_WINDOWS, POLICIES, ROOM_BELOW_KV
from kvcake.sim.plots import plot_lines
from kvcake.sim.pool_loads import BUCKET_S, PoolDemand, PoolLoads

if TYPE_CHECKING:
    from kvcake.sim.config import SimConfig
    from kvcake.sim.reproduce import Context

PAPER_REJECTED = {"decode_after_prefill": 4183, "early": 3771, "prediction": 3589}


def regime_of(load_p: float, load_d: float) -> str:
    """Which pool the offered load overloads (loads as multiples of each pool's capacity)."""
    if load_d > 1 >= load_p:
        return "decode-bound (the decode pool overloaded, the prefill pool with headroom)"
    if load_p > 1 >= load_d:
        return "prefill-bound (the prefill pool overloaded, the decode pool with headroom)"
    if load_p > 1 and load_d > 1:
        return "both pools overloaded"
    return "no pool overloaded on average"


def saved_per_turned_away(base: dict[str, int], policy: dict[str, int]) -> float | None:
    """Later rejections (TTFT at arrival, or after prefill) a policy avoided relative to the
    baseline per request it turned away at arrival for the decode load: above 1 the policy
    rejects fewer requests in all than the baseline, below 1 more."""
    turned_away = policy.get("tbt_slo", 0)
    if not turned_away:
        return None
    later = ("ttft_slo", "tbt_slo_after_prefill")
    return (sum(base.get(k, 0) for k in later) - sum(policy.get(k, 0) for k in later)) / turned_away


def setting_lines(base: SimConfig, mean_out: int, t_d: float, demand: PoolDemand) -> list[str]:
    """The set-up every policy shares and the offered load against each pool's capacity."""
    cap_p, cap_d = demand.capacity(base.num_prefill, base.num_decode)
    offered = demand.arrival_rate * base.speed
    load_p, load_d = offered / cap_p, offered / cap_d
    return [
        f"{base.num_prefill} prefill + {base.num_decode} decode nodes, global_cache; the "
        f"Conductor is told {mean_out} output tokens for every request (the trace's mean); "
        f"prediction-based rejection forecasts with a uniform t_d = {t_d:.1f} s (the baseline "
        f"run's mean decode time; the bound mean output x TBT SLO would be "
        f"{mean_out * base.tbt_slo_ms / 1000:.1f} s). Every decode node checks and reserves "
        f"each request's prompt plus the same told {mean_out} output tokens (never its true "
        "length, which no live node knows at hand-off); a request that outgrows it grows its "
        "KV while the node has room, else the newest of the batch is preempted (swapped out, "
        "resumed when room frees: `decode preemptions`). The baseline checks the decode side "
        "(TBT SLO and KV memory) when the prefill ends, "
        + ("on the decode node chosen at arrival only (its KV streamed there; "
           "`--decode-check-keeps-node`), which takes the request if it can start it at once, "
           "else it is rejected; " if base.decode_check_keeps_node else
           "and its decode node takes a request only if it can start it at once (its KV "
           "reserved beside the batch's), else the node with the most room that can; ")
        + "early and prediction "
        "decide at arrival, finally "
        + ("(the decode instance chosen then is their admission test; when the prefill ends "
           "the request goes to that instance if it can start it at once, else to the decode "
           "instance with the most room if that one can, its KV streamed again, else it waits "
           "at the first for memory: re-selection at hand-off, `--decode-reselect-at-handoff`)"
           if base.decode_reselect_at_handoff else
           "(the decode instance pre-selected then, as the seed's "
           "Algorithm 1: a request that finds it full waits there for memory)")
        + "; the rows "
        "`+check_after_prefill` run them with the baseline's check after prefill kept as well. "
        "Each decode node reports the KV it holds to the Conductor in every run.", "",
        f"The load (`pool_demand`, on the cost model): a request needs {demand.prefill_s:.3f} "
        f"prefill node-s (all earlier blocks cached) and holds {demand.decode_s:.3f} decode "
        f"node-s (its KV on a memory-full node for its output's steps): the prefill pool serves "
        f"at most {cap_p:.1f} requests/s, the decode pool {cap_d:.1f}. Offered at speed "
        f"{base.speed:g}: {offered:.1f} requests/s = {load_p:.2f}x the prefill pool's "
        f"capacity, {load_d:.2f}x the decode pool's: {regime_of(load_p, load_d)}.", ""]



def rejection_lines(results: dict[str, dict[str, Any]], num_requests: int) -> list[str]:
    """The rejections table and the paper's order against ours."""
    lines = [
        "| policy | rejected | at arrival (TTFT) | at arrival (decode load) | after prefill "
        "| wasted prefill (s) | served within SLOs | served late (SLO missed) | mean TBT (ms) "
        "| mean TTFT (s) | decode preemptions | paper's rejected |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        by = r["rejected_by_reason"]
        paper = PAPER_REJECTED.get(name)
        lines.append(
            f"| {name} | {r['rejected']:,} | {by.get('ttft_slo', 0):,} | "
            f"{by.get('tbt_slo', 0):,} | {by.get('tbt_slo_after_prefill', 0):,} | "
            f"{r['wasted_prefill_s']:,.0f} | {r['effective_share']:.3f} | "
            f"{r['served_late']:,} | {r['mean_tbt_ms']:.0f} | {r['mean_ttft_s']:.2f} | "
            f"{r['decode_preemptions']:,} | {'-' if paper is None else format(paper, ',')} |")
    counts = [results[n]["rejected"] for n in POLICIES]
    order = "holds" if counts[0] > counts[1] > counts[2] else "does NOT hold"
    checked = [counts[0], *(results[n]["rejected"] for n in CHECKED)]
    checked_order = "holds" if checked[0] > checked[1] > checked[2] else "does NOT hold"
    return lines + [
        "", f"Paper (arXiv version, 8P+8D, 2x replay): rejected 4,183 -> 3,771 -> 3,589 "
        f"for baseline -> early -> prediction-based. Ours: the strict order {order} "
        f"({' > '.join(f'{c:,}' for c in counts)}; {num_requests:,} requests); with the "
        f"check after prefill kept it {checked_order} "
        f"({' > '.join(f'{c:,}' for c in checked)}). Served within SLOs: "
        + ", ".join(f"{n} {r['effective_share']:.3f}" for n, r in results.items()) + ".", ""]


def mechanism_lines(results: dict[str, dict[str, Any]], t_d: float, window: float) -> list[str]:
    """The mechanism table: lag against t_d, the pools' loads, their correlation and swings."""
    lines = [
        "The mechanism: the lag over all requests that decoded; the loads over the "
        f"second half of the arrival window ({window / 2:.0f} to {window:.0f} s, in "
        f"{BUCKET_S:g} s buckets), past the ramp-up (the decode pool filling from empty, "
        "the prefix caches warming up):", "",
        "| policy | lag: arrival to decode join (s) | lag / t_d | prefill busy | prefill "
        "queue (requests per node) | decode KV in use | decode batch per node "
        "| waiting for decode (requests per node) | moved at hand-off "
        "| prefill-s per served request | turned away with room at join "
        f"| top decode node's share of a {HERD_WINDOW_S:g} s window's placements (mean / max) "
        "| corr(prefill queue, decode KV) | decode KV swing (CV) | prefill queue swing "
        "(CV) | later rejections saved per arrival rejection |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base_by = results["decode_after_prefill"]["rejected_by_reason"]
    for name, r in results.items():
        lag = r["lag_s"]
        saved = saved_per_turned_away(base_by, r["rejected_by_reason"])
        lines.append(
            f"| {name} | {'-' if lag is None else format(lag, '.1f')} | "
            f"{'-' if lag is None else format(lag / t_d, '.2f')} | {r['prefill_busy']:.2f} | "
            f"{r['prefill_queue']:.2f} | {r['decode_kv']:.2f} | {r['decode_batch']:.1f} | "
            f"{r['decode_wait']:.1f} | {r['moved_at_handoff']:,} | "
            f"{_opt(r['prefill_s_per_served'], '.4f')} | {_opt(r['turned_away_with_room'], '.3f')} | "
            f"{_herd(r['herding'])} | "
            f"{r['corr']:+.2f} | {r['decode_kv_cv']:.2f} | {r['prefill_queue_cv']:.2f} | "
            f"{'-' if saved is None else format(saved, '.2f')} |")
    return lines + [
        "", "corr: -1 when the two pools' loads move in anti-phase, the paper's load "
        "fluctuation; CV: standard deviation over mean of a load across buckets. Saved per "
        "arrival rejection: (the baseline's TTFT and after-prefill rejections minus the "
        "policy's) per request the policy turned away at arrival for the decode load; "
        "above 1 the policy rejects fewer in all than the baseline. Waiting for decode: "
        "prefilled, KV on its way or waiting at the decode node for memory. Moved at hand-off: "
        "requests sent to another decode node than the one chosen at arrival (their KV "
        "streamed again). Prefill-s per served request: the mean prefill compute of the "
        "requests served (late ones too): a dearer served mix serves fewer on the same prefill. "
        "Turned away with room at join: the share of the requests turned away at arrival for "
        f"the decode load whose predicted join time met the decode pool below {ROOM_BELOW_KV:g} "
        "of its KV in the run's own loads: the arrival check's errors. Top decode node's share: "
        f"in each {HERD_WINDOW_S:g} s window of arrivals, the placements pre-selected to the "
        "decode node that got the most, over the window's placements (1 / decode nodes when "
        "they spread evenly; near 1 when a burst herds onto one node).", ""]


def window_lines(results: dict[str, dict[str, Any]], window: float) -> list[str]:
    """Where each run's rejections come from: per arrival window, those at arrival for the
    TTFT, at arrival for the decode load, after the prefill, and the decode pool's KV in use."""
    names = list(results)
    lines = [
        f"Where the rejections come from, by arrival window ({NUM_WINDOWS} of "
        f"{window / NUM_WINDOWS:.0f} s): rejected at arrival for the TTFT / at arrival for the "
        "decode load / after prefill, and (in brackets) the decode pool's mean KV in use in the "
        "window:", "",
        "| arrival window (s) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names)]
    for w in range(NUM_WINDOWS):
        lo, hi = w * window / NUM_WINDOWS, (w + 1) * window / NUM_WINDOWS
        cells = []
        for name in names:
            t, d, a = results[name]["rejected_by_window"][w]
            cells.append(f"{t:,} / {d:,} / {a:,} ({results[name]['decode_kv_by_window'][w]:.2f})")
        lines.append(f"| {lo:.0f}-{hi:.0f} | " + " | ".join(cells) + " |")
    return lines + [""]


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _herd(shares: tuple[float, float] | None) -> str:
    return "-" if shares is None else f"{shares[0]:.2f} / {shares[1]:.2f}"


def plot_loads(ctx: Context, loads: dict[str, PoolLoads]) -> None:
    """One panel per run: its pools' loads over time."""
    panels = []
    for name, pl in loads.items():
        peak = max(pl.prefill_queue) or 1.0
        wait_peak = max(pl.decode_wait) or 1.0
        panels.append(("time (s)", f"{name}: load",
                       {"prefill busy share": (pl.times, pl.prefill_busy),
                        f"prefill queue (/ {peak:.1f} per node)": (
                            pl.times, [x / peak for x in pl.prefill_queue]),
                        "decode KV in use (share)": (pl.times, pl.decode_kv),
                        f"waiting for decode (/ {wait_peak:.1f} per node)": (
                            pl.times, [x / wait_peak for x in pl.decode_wait])}))
    plot_lines(ctx.out / f"overload_{ctx.stem}.png", f"Pool loads under overload, {ctx.stem}",
               panels, marker=None)
