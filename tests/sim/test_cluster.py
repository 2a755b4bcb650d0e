"""Golden runs of the simulated cluster: placements and latencies worked out by hand."""

from __future__ import annotations

import json

import pytest

from kvcake.conductor import CostModel
from kvcake.sim.config import SimConfig
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace, TraceRequest
from kvcake.sim.tracegen import TraceGenConfig, generate_trace

ROOFLINE = "llama3-70b@a800x8-roofline"  # the hand versions below are the bare roofline
COST = CostModel.from_spec(ROOFLINE)
FLOPS = 8 * 312e12 * 0.5  # a800x8 peak x MFU
KV_BYTES = 80 * 2 * 8 * 128 * 2  # llama3-70b: 320 KiB per token
NIC = 100e9  # 4 x 200 Gbps in bytes/s
HBM = 8 * 2039e9 * 0.8


def prefill_s(n: int, p: int = 0) -> float:
    """The paper's prefill cost, tokens p..n each attending to all n: l(a(n-p)n d + b(n-p)d^2)."""
    return 80 * (4 * (n - p) * n * 8192 + 22 * (n - p) * 8192**2) / FLOPS


def step_s(context_tokens: int) -> float:
    """A memory-bound decode step: weights plus the batch's KV over HBM bandwidth."""
    return (COST.model.weight_bytes + context_tokens * KV_BYTES) / HBM


def _trace(*rows: tuple[float, int, int, list[int]]) -> Trace:
    reqs = tuple(TraceRequest(i, ts, n, out, tuple(ids)) for i, (ts, n, out, ids) in enumerate(rows))
    return Trace(reqs, "golden")


def test_cost_formulas_match_the_hand_versions() -> None:
    assert COST.model.kv_bytes_per_token == KV_BYTES
    assert COST.prefill_time_s(1024) == pytest.approx(prefill_s(1024))
    assert COST.decode_step_time_s(1, 1024) == pytest.approx(step_s(1024))


def test_local_cache_golden_placements_ttft_and_tbt() -> None:
    trace = _trace(
        (0, 1024, 2, [1, 2]),
        (0, 1024, 2, [3, 4]),
        (10_000, 1536, 1, [1, 2, 5]),  # shares r0's 2 blocks
    )
    res = simulate(SimConfig(num_prefill=2, num_decode=1, policy="local_cache", profile=ROOFLINE), trace)
    r0, r1, r2 = (s.record() for s in res.states)
    assert [(r["prefill_instance"], r["decode_instance"]) for r in (r0, r1, r2)] == [
        ("prefill-0", "decode-0"), ("prefill-1", "decode-0"), ("prefill-0", "decode-0")]
    p = prefill_s(1024)
    assert r0["ttft_s"] == pytest.approx(p, abs=1e-6)
    assert r1["ttft_s"] == pytest.approx(p, abs=1e-6)
    # r2 reuses r0's 1024 cached tokens and computes the last 512.
    assert r2["prefix_reused_tokens"] == 1024
    assert r2["ttft_s"] == pytest.approx(prefill_s(1536, 1024), abs=1e-6)
    # Both KV hand-offs land before the prefills end. r0 joins the idle decode instance; r1
    # arrives at the same instant and joins at the next step boundary, after r0's only step.
    s = step_s(1024)
    assert r0["tbt_s"] == pytest.approx(s, abs=1e-6)
    assert r1["tbt_s"] == pytest.approx(2 * s, abs=1e-6)
    assert r2["tbt_s"] is None  # one output token: no gaps
    assert res.summary["completed"] == 3
    assert res.summary["transfer_bytes"] == (1024 + 1024 + 1536) * KV_BYTES
    assert res.summary["cache_hit_rate"] == pytest.approx(1024 / (1024 + 1024 + 1536))


def test_global_cache_fetches_a_busy_holders_prefix_under_nic_contention() -> None:
    trace = _trace(
        (0, 2048, 2, [1, 2, 3, 4]),
        (0, 2048, 2, [11, 12, 13, 14]),
        (1000, 16384, 2, list(range(100, 132))),  # keeps prefill-0 busy for ~3 s
        (1001, 2560, 2, [1, 2, 3, 4, 5]),  # r0's prefix, held by the busy prefill-0
    )
    res = simulate(SimConfig(num_prefill=2, num_decode=1, policy="global_cache", profile=ROOFLINE), trace)
    r2, r3 = res.states[2].record(), res.states[3].record()
    assert r2["prefill_instance"] == "prefill-0"
    assert r3["prefill_instance"] == "prefill-1"
    assert (r3["fetched_tokens"], r3["prefix_reused_tokens"]) == (2048, 2048)
    # The fetch leaves node 0 while r2's KV streams out of node 0 to the decode node: both
    # flows share node 0's egress, so the fetch runs at half the NIC for its whole length.
    fetch_s = 2048 * KV_BYTES / (NIC / 2)
    assert res.states[3].fetch_s == pytest.approx(fetch_s, rel=1e-9)
    assert res.states[3].ttft_s == pytest.approx(fetch_s + prefill_s(2560, 2048), rel=1e-9)


def test_colocated_uses_all_instances_for_both_roles() -> None:
    trace = _trace((0, 1024, 3, [1, 2]), (50, 1024, 2, [3, 4]))
    res = simulate(SimConfig(num_prefill=1, num_decode=1, policy="colocated", profile=ROOFLINE), trace)
    # 1 + 1 nodes make 2 colocated instances: r1 goes to the idle one and nothing stalls.
    r0, r1 = (s.record() for s in res.states)
    assert (r0["prefill_instance"], r1["prefill_instance"]) == ("colocated-0", "colocated-1")
    assert r0["decode_instance"] == "colocated-0"
    assert r1["ttft_s"] == pytest.approx(prefill_s(1024), abs=1e-6)


def test_colocated_single_instance_golden_stall() -> None:
    trace = _trace((0, 1024, 3, [1, 2]), (50, 1024, 2, [3, 4]))
    cfg = SimConfig(num_prefill=1, num_decode=1, policy="colocated", max_batch_size=8, profile=ROOFLINE,
                    chunk_budget_tokens=512)
    from kvcake.sim.cluster import Cluster
    from kvcake.sim.run import arrivals_of

    cluster = Cluster(cfg, arrivals_of(trace))
    cluster.decodes = cluster.decodes[:1]  # one instance: make the stall visible
    cluster.conductor.remove_instance("colocated-1")
    cluster.prefill_ids = cluster.prefill_ids[:1]
    cluster.run()
    r0, r1 = (s.record() for s in cluster.states)
    p = prefill_s(1024)
    # r1 arrives during r0's prefill; it runs right after it (prefill first), stalling r0.
    assert r0["ttft_s"] == pytest.approx(p, abs=1e-6)
    assert r1["ttft_s"] == pytest.approx(2 * p - 0.05, abs=1e-6)
    s1, s2 = step_s(2048), step_s(1025)
    # r0's gaps: (r1's prefill + one shared step), then one step alone; TBT = the slowest.
    assert r0["tbt_s"] == pytest.approx(p + s1, abs=1e-6)
    assert r1["tbt_s"] == pytest.approx(s1, abs=1e-6)
    assert r0["finish_s"] == pytest.approx(2 * p + s1 + s2, abs=1e-6)


def test_colocated_prefills_are_reported_started_at_their_first_chunk() -> None:
    """As a live colocated worker's `PrefillStarted`: the Conductor's queue of an instance runs
    a prefill down from its first chunk, so a request queued behind another starts the clock
    only when the one ahead has its first token."""
    trace = _trace((0, 1024, 3, [1, 2]), (0, 1024, 3, [3, 4]), (50, 1024, 2, [5, 6]))
    cfg = SimConfig(num_prefill=1, num_decode=1, policy="colocated", max_batch_size=8,
                    profile=ROOFLINE, chunk_budget_tokens=512)
    from kvcake.sim.cluster import Cluster
    from kvcake.sim.run import arrivals_of

    cluster = Cluster(cfg, arrivals_of(trace))
    started: list[tuple[str, str, float]] = []
    report = cluster.conductor.on_prefill_started

    def spy(instance_id: str, request_id: str, now_s: float) -> None:
        started.append((instance_id, request_id, now_s))
        report(instance_id, request_id, now_s)

    cluster.conductor.on_prefill_started = spy  # type: ignore[method-assign]
    cluster.run()
    r0, r1, r2 = cluster.states
    assert started[:2] == [("colocated-0", r0.request_id, 0.0),
                           ("colocated-1", r1.request_id, 0.0)]
    ahead = r0 if r2.prefill_instance == "colocated-0" else r1
    assert ahead.first_token_s is not None and ahead.first_token_s > 0.05
    assert started[2:] == [(r2.prefill_instance, r2.request_id, ahead.first_token_s)]


def test_chunked_prefill_does_not_stall_decodes() -> None:
    trace = _trace((0, 1024, 40, [1, 2]), (500, 8192, 2, list(range(10, 26))))
    base = dict(num_prefill=1, num_decode=1, policy="colocated", max_batch_size=8,
                chunk_budget_tokens=520, prefix_cache=False, profile=ROOFLINE)
    from kvcake.sim.cluster import Cluster
    from kvcake.sim.run import arrivals_of

    tbt = {}
    for chunked in (False, True):
        cluster = Cluster(SimConfig(chunked_prefill=chunked, **base), arrivals_of(trace))
        # Force both requests onto one instance (index 0) by dropping the second.
        cluster.decodes = cluster.decodes[:1]
        cluster.conductor.remove_instance("colocated-1")
        cluster.prefill_ids = cluster.prefill_ids[:1]
        cluster.run()
        tbt[chunked] = cluster.states[0].gaps.max_gap_s()
    assert tbt[False] == pytest.approx(prefill_s(8192), rel=1e-3, abs=0.02)  # one big stall
    # Chunked: each step is a decode step plus 512 tokens' share of the 8192-token prefill.
    assert tbt[True] == pytest.approx(step_s(1024 + 40) + prefill_s(8192) * 512 / 8192, rel=0.05)


def _small_trace(seed: int = 0) -> Trace:
    return generate_trace(TraceGenConfig(num_requests=150, rate_per_s=4.0, seed=seed))


def test_same_seed_gives_byte_identical_summary_and_records() -> None:
    trace = _small_trace()
    runs = [simulate(SimConfig(policy="random", seed=7), trace) for _ in range(2)]
    dumps = [json.dumps(r.summary, sort_keys=True) for r in runs]
    assert dumps[0] == dumps[1]
    assert [s.record() for s in runs[0].states] == [s.record() for s in runs[1].states]
    other = simulate(SimConfig(policy="random", seed=8), trace)
    assert [s.prefill_instance for s in other.states] != \
        [s.prefill_instance for s in runs[0].states]


@pytest.mark.parametrize("policy", ["random", "load_balance", "local_cache", "global_cache",
                                    "colocated"])
def test_every_request_is_accounted_for(policy: str) -> None:
    res = simulate(SimConfig(policy=policy, num_prefill=2, num_decode=2), _small_trace(1))
    s = res.summary
    assert s["completed"] + s["rejected"] == s["requests"] == 150
    assert all(st.finish_s is not None or st.rejected is not None for st in res.states)
    assert 0.0 <= s["cache_hit_rate"] <= 1.0


def test_store_tier_serves_fetches() -> None:
    res = simulate(SimConfig(policy="global_cache", num_prefill=2, num_decode=2,
                             local_cache_tokens=20_000, store_tokens=2_000_000),
                   _small_trace(2))
    assert res.summary["fetched_tokens"] > 0
    assert res.summary["completed"] + res.summary["rejected"] == 150


def test_shared_trace_slice_runs(shared_traces) -> None:  # type: ignore[no-untyped-def]
    from kvcake.sim.trace import load_trace

    trace = load_trace(shared_traces / "conversation_trace.jsonl")
    res = simulate(SimConfig(policy="global_cache", max_requests=300), trace)
    assert res.summary["requests"] == 300
    assert res.summary["completed"] >= 290
    assert res.summary["cache_hit_rate"] > 0.05
