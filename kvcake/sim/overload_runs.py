"""The overload report's runs: each admission policy as a `PolicyRun`, the SimConfig changes it
makes (`run_changes`), and running them all on one load (`run_policies`): each run's
rejections, SLOs, lag and its pools' loads in the steady window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcake.sim.pool_loads import PoolLoads, pool_loads, swing, value_at, window_mean

# A decode pool below this share of its KV has room for more requests (the arrival check's
# turn-aways that met such a pool at their join time were forecast errors).
ROOM_BELOW_KV = 0.9

if TYPE_CHECKING:
    from kvcake.sim.records import RequestState
    from kvcake.sim.reproduce import Context
    from kvcake.sim.run import SimResult


@dataclass(frozen=True)
class PolicyRun:
    """One run of the report: the Conductor's admission mode, and whether the decode side is
    checked (and the decode node guarded) again when the prefill ends."""

    admission: str
    decode_check_after_prefill: bool


POLICIES: dict[str, PolicyRun] = {
    "decode_after_prefill": PolicyRun("decode_after_prefill", True),
    "early": PolicyRun("slo", False),
    "prediction": PolicyRun("early", False)}
# The arrival policies with the decode check kept after prefill as well (a second filter in
# front of the baseline's): what the report ran as early and prediction before.
CHECKED: dict[str, PolicyRun] = {
    "early+check_after_prefill": PolicyRun("slo", True),
    "prediction+check_after_prefill": PolicyRun("early", True)}


def run_changes(run: PolicyRun, t_d: float, mean_out: int) -> dict[str, Any]:
    """The SimConfig changes of one run: every run is told the trace's mean output and t_d, and
    has its decode nodes report their KV (`decode_node_guard`, which places requests only where
    the decode side is checked after prefill)."""
    return {"policy": "global_cache", "admission": run.admission, "uniform_decode_s": t_d,
            "predicted_output_len": mean_out,
            "decode_check_after_prefill": run.decode_check_after_prefill,
            "decode_node_guard": True}


def mean_decode_s(states: list[RequestState]) -> float | None:
    """Mean seconds from joining a decode batch to the last token, over finished requests."""
    spans = [s.finish_s - s.decode_join_s for s in states
             if s.decode_join_s is not None and s.finish_s is not None]
    return sum(spans) / len(spans) if spans else None


def mean_lag_s(states: list[RequestState]) -> float | None:
    """Mean seconds from arrival (the admission decision) to joining a decode batch, over the
    requests that joined: how stale a decode load read at arrival is when the request lands."""
    lags = [s.decode_join_s - s.arrival.arrival_s for s in states if s.decode_join_s is not None]
    return sum(lags) / len(lags) if lags else None


def run_policies(ctx: Context, mean_out: int, kv_capacity: int, window: float
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, PoolLoads], float]:
    """Each run's results, its pools' loads, and t_d (learned from the baseline's run, which
    runs first; the bound mean output x TBT SLO until then)."""
    base = ctx.base
    t_d = mean_out * base.tbt_slo_ms / 1000.0
    results: dict[str, dict[str, Any]] = {}
    loads: dict[str, PoolLoads] = {}
    for name, run in {**POLICIES, **CHECKED}.items():
        res = ctx.sim(**run_changes(run, t_d, mean_out))
        if name == "decode_after_prefill":
            t_d = mean_decode_s(res.states) or t_d
        loads[name] = pool_loads(res.states, base.num_prefill, base.num_decode, kv_capacity,
                                 res.summary["makespan_s"])
        results[name] = policy_result(res, loads[name], window)
    return results, loads, t_d


HERD_WINDOW_S = 10.0  # arrival windows in which `herding` counts each node's share


def herding(states: list[RequestState], window_s: float = HERD_WINDOW_S
            ) -> tuple[float, float] | None:
    """(mean, largest) over the `window_s` arrival windows holding a placed request of the share
    of the window's placements pre-selected to the one decode node that got the most: 1 / (decode
    nodes) when arrivals spread evenly, 1 when every arrival of a window goes to one node. None:
    nothing placed."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    windows: dict[int, dict[str, int]] = {}
    for s in states:
        if s.preselected_decode is not None:
            counts = windows.setdefault(int(s.arrival.arrival_s // window_s), {})
            counts[s.preselected_decode] = counts.get(s.preselected_decode, 0) + 1
    if not windows:
        return None
    shares = [max(c.values()) / sum(c.values()) for c in windows.values()]
    return sum(shares) / len(shares), max(shares)


NUM_WINDOWS = 6  # equal arrival windows of `rejections_by_window`
REASONS = ("ttft_slo", "tbt_slo", "tbt_slo_after_prefill")  # TTFT / decode at arrival / after


def rejections_by_window(states: list[RequestState], window_s: float,
                         num_windows: int = NUM_WINDOWS) -> list[tuple[int, ...]]:
    """Per arrival window (`window_s` / `num_windows` seconds each from 0; later arrivals count
    in the last): the requests rejected for each of `REASONS`, in that order: where in time a
    policy's rejections come from, and whether at arrival or after the prefill."""
    if window_s <= 0 or num_windows < 1:
        raise ValueError(f"window_s must be > 0 and num_windows >= 1, got {window_s}, "
                         f"{num_windows}")
    counts = [[0] * len(REASONS) for _ in range(num_windows)]
    for s in states:
        if s.rejected in REASONS:
            w = min(num_windows - 1, max(0, int(s.arrival.arrival_s / window_s * num_windows)))
            counts[w][REASONS.index(s.rejected)] += 1
    return [tuple(c) for c in counts]


def served_prefill_s(states: list[RequestState]) -> float | None:
    """Mean prefill seconds of the requests served (late ones too): how dear the served mix is."""
    served = [s.prefill_s for s in states if s.finish_s is not None and s.rejected is None]
    return sum(served) / len(served) if served else None


def turned_away_with_room(states: list[RequestState], pl: PoolLoads) -> float | None:
    """Share of the requests turned away at arrival for the decode load whose predicted join
    time (arrival + predicted TTFT) met the decode pool below ROOM_BELOW_KV of its KV, in the
    run's own loads: the arrival check's errors (the pool had room when they would have
    joined)."""
    away = [s for s in states if s.rejected == "tbt_slo"]
    if not away:
        return None
    roomy = sum(1 for s in away if value_at(
        pl.times, pl.decode_kv, s.arrival.arrival_s + (s.predicted_ttft_s or 0.0)) < ROOM_BELOW_KV)
    return roomy / len(away)


def policy_result(res: SimResult, pl: PoolLoads, window: float) -> dict[str, Any]:
    """One policy's rejections, SLOs, lag and its pools' loads in the steady window."""
    s = res.summary
    # Means, swings and correlation in the steady part, the second half of the arrival
    # window: past the ramp-up (the decode pool fills from empty in a decode lifetime or
    # two, and the prefix caches warm up: ~200 s of 521 on the balanced trace).
    steady = (window / 2, window)
    corr, kv_cv = swing(pl.times, pl.prefill_queue, pl.decode_kv, *steady)
    _, queue_cv = swing(pl.times, pl.decode_kv, pl.prefill_queue, *steady)
    return {"rejected": s["rejected"], "wasted_prefill_s": s["wasted_prefill_s"],
            "rejected_by_reason": s["rejected_by_reason"],
            "effective_share": s["effective_request_capacity"],
            "served_late": s["completed"] - s["effective_requests"],
            # decode nodes reserve prompt + told output: a longer request grows past it and,
            # where the node is full, the newest of its batch is preempted (decode.py)
            "decode_preemptions": s["decode_preemptions"],
            "mean_tbt_ms": 1000 * s["tbt_s"]["mean"],
            "mean_ttft_s": s["ttft_s"]["mean"],
            # Sent to another decode node at hand-off than the one chosen at arrival (the
            # baseline's re-choice, or `decode_reselect_at_handoff`): its KV streamed again.
            "moved_at_handoff": sum(1 for st in res.states if st.kv_epoch > 0),
            "prefill_s_per_served": served_prefill_s(res.states),
            "turned_away_with_room": turned_away_with_room(res.states, pl),
            "herding": herding(res.states),
            "rejected_by_window": rejections_by_window(res.states, window),
            "decode_kv_by_window": [window_mean(pl.times, pl.decode_kv, w * window / NUM_WINDOWS,
                                                (w + 1) * window / NUM_WINDOWS)
                                    for w in range(NUM_WINDOWS)],
            "corr": corr, "decode_kv_cv": kv_cv,
            "prefill_queue_cv": queue_cv, "lag_s": mean_lag_s(res.states),
            "prefill_busy": window_mean(pl.times, pl.prefill_busy, *steady),
            "prefill_queue": window_mean(pl.times, pl.prefill_queue, *steady),
            "decode_kv": window_mean(pl.times, pl.decode_kv, *steady),
            "decode_batch": window_mean(pl.times, pl.decode_batch, *steady),
            "decode_wait": window_mean(pl.times, pl.decode_wait, *steady)}
