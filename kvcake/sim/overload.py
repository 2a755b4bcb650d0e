"""`kvcake reproduce overload`: rejection under overload (arXiv version, section 7).

The same cluster (8 prefill + 8 decode nodes, global_cache) and load, three admission policies:

    decode_after_prefill   TTFT checked at arrival; the decode side only once the prefill is
                           done, so a request rejected there has spent its prefill (the baseline)
    early                  (admission "slo") TTFT and the decode instance's TBT *now*, at
                           arrival: the paper's early rejection, on the decode load of the moment
                           (each node's batch plus the requests dispatched to it and still in
                           prefill: its outstanding load, which it also picks the node by)
    prediction             (admission "early") TTFT and the TBT forecast for the moment the
                           prefill would end, at arrival: prediction-based early rejection

Early rejection *moves* the decode check to arrival: the arrival decision is final and the
decode instance is the one chosen then (the seed's Algorithm 1, lines 17-19, and its workflow's
step 4: "the decoding instance is pre-selected by Conductor based on its current load"). A
request that finds its decode node full when its prefill ends waits there for memory (a wait
that lands in its slowest token gaps: served, but late), where the baseline rejects it. With
`--decode-reselect-at-handoff` (`decode_reselect_at_handoff`) the choice at arrival stays the
admission test, but a request whose node cannot start it when its prefill ends goes to the
decode node with the most room if that one can (its KV streamed again), as the baseline's
re-choice at prefill end does; the seed streams the KV to the pre-selected node and is silent on
a node that is full at hand-off. With `--decode-check-keeps-node` the baseline's check asks only
the decode node chosen at arrival (no re-choice at prefill end), pre-selected on the forecast
at the request's predicted join time as prediction does (read now, a burst herds onto one node;
the report's top-node column measures it). The report also runs both arrival policies with the decode check kept after prefill as well
(`CHECKED`: the form of this report before; the decode pool never overfills, so the lag of the
arrival check cannot build up a swing). In every run each decode node reports the KV it holds
to the Conductor (`decode_node_guard`); under the baseline and `CHECKED` the node also takes a
request after prefill only if it can start it at once: without that, the Conductor's book
(every request at the told mean output) undercounts a running batch, which holds the long
outputs longest, and a request it admits waits at the node for memory (on the balanced regime
7,692 of 18,347 served requests of the baseline broke the TBT SLO that way). Every policy is
told one output length for all requests (the trace's mean; the Conductor never sees a
request's own), and prediction-based rejection forecasts with the paper's uniform decode time
t_d, which a live system learns from its history: here the mean decode time (join to finish) of
the baseline's run, which runs first (neither the baseline nor early rejection reads t_d: they
look at the decode load of the moment).

Why the paper's loads swing (its section 7.3), and what the report measures: a check on the
decode load *now* lags the decode load it causes by the prefill's queue and compute time (the
form before 2026-12-02 read only the batch and what was due to have joined; early rejection now
counts what is dispatched to a node, so it lags the *releases* instead: room that frees while a
request is in prefill is not counted for it). While
decode is full, early rejection turns arrivals away, the prefill pool runs dry, and by the time
those requests would have reached decode it has drained and idles; then the Conductor admits a
burst that fills the prefill queues (up to the TTFT SLO) and reaches decode a queue-time later,
all at once, where it waits for memory (with the check kept after prefill, part of it is
rejected there instead, its prefill spent, and the decode pool never overfills). Prediction-based
rejection counts the requests already in prefill that will have joined by then, so it admits
what decode can take when they arrive. The report shows each pool's load over time (prefill:
busy share of the prefill nodes and requests waiting or running per prefill node, which unlike a
busy share can rise above 1; decode: the share of the pool's KV memory in use, the resource that
binds a decode node in this cost model, and the requests prefilled and waiting for it), the
correlation of the two and each one's swing, besides rejected requests (by reason), wasted
prefill seconds, requests served but late, the lag from arrival to decode join against t_d, and
how many later rejections each arrival rejection saved against the baseline.

`pool_demand` prices the trace on the cost model (each pool's node-seconds per request), so the
report states how far the load exceeds each pool's capacity: the regime is set from that, not
from the outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcake.sim.overload_report import (
    PAPER_REJECTED,
    mechanism_lines,
    plot_loads,
    regime_of,
    rejection_lines,
    saved_per_turned_away,
    setting_lines,
    window_lines,
)
from kvcake.sim.overload_runs import (
    CHECKED,
    POLICIES,
    PolicyRun,
    mean_decode_s,
    mean_lag_s,
    run_changes,
    run_policies,
)
from kvcake.sim.pool_loads import (
    BUCKET_S,
    PoolDemand,
    PoolLoads,
    pool_demand,
    pool_loads,
    swing,
    window_mean,
)
from kvcake.sim.topology import cost_model, kv_capacity_tokens

if TYPE_CHECKING:
    from kvcake.sim.reproduce import Context

# The report's names, importable from here as before the split.
__all__ = ["BUCKET_S", "CHECKED", "PAPER_REJECTED", "POLICIES", "PolicyRun", "PoolDemand",
           "PoolLoads", "mean_decode_s", "mean_lag_s", "overload", "pool_demand", "pool_loads",
           "regime_of", "run_changes", "saved_per_turned_away", "swing", "window_mean"]


def overload(ctx: Context) -> list[str]:
    base = ctx.base
    trace = ctx.trace if base.max_requests is None else ctx.trace.sampled(first=base.max_requests)
    requests = trace.requests
    mean_out = max(1, round(sum(r.output_len for r in requests) / max(1, len(requests))))
    cost = cost_model(base)
    kv_capacity = kv_capacity_tokens(cost)
    demand = pool_demand(trace, cost, kv_capacity, base.block_size)
    start_ms = requests[0].timestamp_ms if requests else 0.0
    window = ((requests[-1].timestamp_ms - start_ms) / 1000 / base.speed
              if requests else 0.0)
    results, loads, t_d = run_policies(ctx, mean_out, kv_capacity, window)
    ctx.data.update({
        "policies": {n: _counts(results[n]) for n in POLICIES},
        "with_check_after_prefill": {n: _counts(results[n]) for n in CHECKED}})
    lines = ctx.header("Overload: rejection policies under overload")
    lines += setting_lines(base, mean_out, t_d, demand)
    lines += rejection_lines(results, len(requests))
    lines += mechanism_lines(results, t_d, window)
    lines += window_lines(results, window)
    plot_loads(ctx, loads)
    return lines


def _counts(result: dict[str, Any]) -> dict[str, Any]:
    """What `--json` prints of one run."""
    return {"rejected": result["rejected"], "wasted_prefill_s": result["wasted_prefill_s"],
            "decode_preemptions": result["decode_preemptions"]}
