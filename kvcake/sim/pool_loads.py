"""Each pool's load in the overload report: what the offered load asks of each pool on the cost
model (`pool_demand`), and the load each pool carries over time, from the requests' records
(`pool_loads`, in BUCKET_S buckets), with the window means and swings the report reads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcake.conductor.cost import CostModel
from kvcake.sim.trace import Trace

if TYPE_CHECKING:
    from kvcake.sim.records import RequestState

BUCKET_S = 10.0


@dataclass(frozen=True)
class PoolDemand:
    """What one request asks of each pool on average, in node-seconds, and the rate it fills.

    prefill_s: prefill compute of its uncached tokens, the cache holding every block seen
        before (the most reuse any policy gets). decode_s: the share of a decode node it holds:
        (prompt + output) KV tokens for output steps of a memory-full node, over the node's KV
        capacity (decode here is bound by memory, not by the TBT SLO: a full node's step is
        under 100 ms).
    """

    prefill_s: float
    decode_s: float
    arrival_rate: float  # requests per second at the trace's own speed

    def capacity(self, num_prefill: int, num_decode: int) -> tuple[float, float]:
        """Requests per second each pool can serve at 100% busy."""
        return num_prefill / self.prefill_s, num_decode / self.decode_s


def request_demand(trace: Trace, cost: CostModel, kv_capacity_tokens: int,
                   block_size: int) -> list[tuple[float, float]]:
    """Each request's (prefill node-s, decode node-s), as `PoolDemand` prices them."""
    seen: set[int] = set()
    out = []
    for r in trace.requests:
        hit = 0
        for key in r.hash_ids:
            if key not in seen:
                break
            hit += 1
        seen.update(r.hash_ids)
        prefill = cost.prefill_time_s(r.input_len, min(hit * block_size, r.input_len - 1))
        context = r.input_len + r.output_len
        step_s = cost.decode_step_time_s(max(1, kv_capacity_tokens // context), kv_capacity_tokens)
        out.append((prefill, context * r.output_len * step_s / kv_capacity_tokens))
    return out


def pool_demand(trace: Trace, cost: CostModel, kv_capacity_tokens: int, block_size: int,
                only: set[int] | None = None) -> PoolDemand:
    """The mean demand per request (of the requests whose positions are in `only`, if given:
    e.g. `prefill_admitted`'s), and their arrival rate over the whole trace's span."""
    costs = request_demand(trace, cost, kv_capacity_tokens, block_size)
    if only is not None:
        costs = [c for i, c in enumerate(costs) if i in only]
    requests = trace.requests
    n, total = max(1, len(costs)), max(1, len(requests))
    span_s = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    rate = (total - 1) / span_s * len(costs) / total if span_s > 0 else math.inf
    return PoolDemand(sum(c[0] for c in costs) / n, sum(c[1] for c in costs) / n, rate)


def prefill_admitted(trace: Trace, cost: CostModel, kv_capacity_tokens: int, block_size: int,
                     prefill_nodes: float, speed: float) -> set[int]:
    """The requests (positions in the trace) a saturated prefill pool admits, in the fluid
    limit of its TTFT check: a full queue sheds the dearest prompts first (a prompt is admitted
    only if the queue plus its own prefill fits the SLO), so the cheapest are kept until their
    prefill fills `prefill_nodes` node-seconds per second over the arrival span replayed at
    `speed`; all of them if the pool does not bind. `prefill_nodes` is the pool's node count
    times its efficiency: the share of node time that goes to admitted prompts at their price
    (below 1 where the pool does more work per request than `pool_demand`'s price, whose cache
    holds every earlier block; e.g. 8 x 0.704). What the decode
    pool is offered under the baseline is priced on these (`pool_demand(..., only=...)`)."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    if not prefill_nodes > 0:
        raise ValueError(f"prefill_nodes (node count x efficiency) must be > 0, "
                         f"got {prefill_nodes!r}")
    costs = request_demand(trace, cost, kv_capacity_tokens, block_size)
    requests = trace.requests
    span_s = (requests[-1].arrival_s - requests[0].arrival_s) / speed if len(requests) > 1 else 0.0
    budget = prefill_nodes * span_s
    kept: set[int] = set()
    spent = 0.0
    for i in sorted(range(len(costs)), key=lambda i: (costs[i][0], i)):
        spent += costs[i][0]
        if spent > budget:
            break
        kept.add(i)
    return kept


@dataclass(frozen=True)
class PoolLoads:
    """Each pool's load per BUCKET_S bucket (time-averaged over the bucket).

    prefill_queue: requests placed on the prefill pool and not prefilled yet (fetching, queued
        or running), per prefill node: what the Conductor's TTFT estimate grows with, and a load
        that can rise above 1 (a busy share cannot: it is 1 whenever a queue exists).
    prefill_busy: share of the prefill nodes' time spent prefilling.
    decode_kv: share of the decode pool's KV memory reserved by decoding requests (prompt +
        output each): the resource that binds a decode node in this cost model (a node full of
        KV still steps under the TBT SLO).
    decode_batch: mean decoding requests per decode node.
    decode_wait: requests prefilled and not decoding yet (their KV on its way, or waiting at
        their decode node for memory), per decode node.
    """

    times: list[float]
    prefill_queue: list[float]
    prefill_busy: list[float]
    decode_kv: list[float]
    decode_batch: list[float]
    decode_wait: list[float]


def pool_loads(states: list[RequestState], num_prefill: int, num_decode: int,
               kv_capacity_tokens: int, end_s: float) -> PoolLoads:
    """Both pools' loads over [0, end_s) in BUCKET_S buckets, from the requests' records."""
    num = max(1, int(end_s // BUCKET_S) + 1)
    queue = [0.0] * num
    busy = [0.0] * num
    kv = [0.0] * num
    batch = [0.0] * num
    wait = [0.0] * num
    for s in states:
        if s.prefill_start_s is not None:
            done_s = s.prefill_start_s + s.prefill_s
            _spread(queue, s.arrival.arrival_s, done_s)
            _spread(busy, s.prefill_start_s, done_s)
            if s.decode_join_s is not None:
                _spread(wait, done_s, s.decode_join_s)
        if s.decode_join_s is not None and s.finish_s is not None:
            _spread(batch, s.decode_join_s, s.finish_s)
            _spread(kv, s.decode_join_s, s.finish_s, s.arrival.input_len + s.arrival.output_len)
    times = [i * BUCKET_S for i in range(num)]
    p, d = BUCKET_S * num_prefill, BUCKET_S * num_decode
    return PoolLoads(times, [x / p for x in queue], [x / p for x in busy],
                     [x / (d * kv_capacity_tokens) for x in kv], [x / d for x in batch],
                     [x / d for x in wait])


def window_mean(times: list[float], values: list[float], begin_s: float, end_s: float) -> float:
    """Mean of the buckets inside [begin_s, end_s)."""
    inside = [v for t, v in zip(times, values, strict=True) if begin_s <= t and t + BUCKET_S <= end_s]
    return sum(inside) / len(inside) if inside else 0.0


def value_at(times: list[float], values: list[float], at_s: float) -> float:
    """The load of the bucket holding `at_s` (the first or last bucket outside the range)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, int(at_s // BUCKET_S)))]


def _spread(buckets: list[float], begin_s: float, end_s: float, weight: float = 1.0) -> None:
    """Add `weight` x the seconds of [begin_s, end_s) to the buckets they fall in."""
    i = int(begin_s // BUCKET_S)
    while begin_s < end_s and i < len(buckets):
        edge = (i + 1) * BUCKET_S
        buckets[i] += weight * (min(end_s, edge) - begin_s)
        begin_s, i = edge, i + 1


def swing(times: list[float], prefill: list[float], decode: list[float], begin_s: float,
          end_s: float) -> tuple[float, float]:
    """Over the buckets inside [begin_s, end_s): the correlation of the prefill and decode loads
    (-1: anti-phase) and the decode load's coefficient of variation (its swing)."""
    pairs = [(p, d) for t, p, d in zip(times, prefill, decode, strict=True)
             if begin_s <= t and t + BUCKET_S <= end_s]
    if len(pairs) < 3:
        return 0.0, 0.0
    n = len(pairs)
    mp = sum(p for p, _ in pairs) / n
    md = sum(d for _, d in pairs) / n
    cov = sum((p - mp) * (d - md) for p, d in pairs) / n
    sp = math.sqrt(sum((p - mp) ** 2 for p, _ in pairs) / n)
    sd = math.sqrt(sum((d - md) ** 2 for _, d in pairs) / n)
    corr = cov / (sp * sd) if sp > 0 and sd > 0 else 0.0
    return corr, (sd / md if md > 0 else 0.0)
