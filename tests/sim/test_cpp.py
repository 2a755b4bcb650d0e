"""Chunked pipeline parallelism in the simulator: a long prompt on a group of prefill nodes."""

from __future__ import annotations

import pytest

from kvcake.conductor import CostModel
from kvcake.sim.config import SimConfig
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace, TraceRequest

COST = CostModel.from_spec("llama3-70b@a800x8")


def _trace(*rows: tuple[float, int, int]) -> Trace:
    return Trace(tuple(TraceRequest(i, ts, n, out, tuple(range(i * 1000, i * 1000 + -(-n // 512))))
                       for i, (ts, n, out) in enumerate(rows)), "cpp")


def test_a_long_prompt_takes_about_chunks_plus_nodes_minus_one_chunk_times() -> None:
    n = 128_000
    trace = _trace((0.0, n, 2))
    alone = simulate(SimConfig(num_prefill=4, num_decode=1), trace).states[0]
    cpp = simulate(SimConfig(num_prefill=4, num_decode=1, cpp_min_tokens=32_000, cpp_nodes=4,
                             cpp_chunk_tokens=2000), trace).states[0]
    assert alone.rejected == "ttft_slo"  # 128k tokens on one node: over the 30 s SLO
    counts = [simulate(SimConfig(num_prefill=4, num_decode=1, **cpp), trace).summary
              ["ttft_rejected_long"] for cpp in ({}, {"cpp_min_tokens": 32_000, "cpp_nodes": 4})]
    assert counts == [1, 0]
    assert cpp.rejected is None and cpp.ttft_s is not None
    chunks = n // 2000
    hw = COST.hardware
    chunk_s = COST.prefill_flops(n) / (hw.peak_flops * hw.mfu_at(2000)) / chunks
    stage = (chunk_s + hw.prefill_step_overhead_s) / 4  # one chunk on a quarter of the layers
    assert cpp.ttft_s == pytest.approx((chunks + 4 - 1) * stage, rel=1e-6)
    assert cpp.ttft_s < COST.prefill_time_s(n) / 3


def test_a_cpp_prefill_waits_for_its_whole_group_and_short_prompts_run_alone() -> None:
    trace = _trace((0.0, 8192, 2), (0.0, 64_000, 2), (0.0, 1024, 2))
    res = simulate(SimConfig(num_prefill=2, num_decode=1, cpp_min_tokens=32_000, cpp_nodes=2,
                             cpp_chunk_tokens=1000), trace)
    short, long, tiny = res.states
    assert long.prefill_group == (0, 1)
    assert short.prefill_group == () and tiny.prefill_group == ()
    assert short.prefill_start_s == 0.0 and short.first_token_s is not None
    # The group starts only once the node busy with the short prompt is free.
    assert long.prefill_start_s == pytest.approx(short.first_token_s)
    assert all(s.finish_s is not None for s in res.states)
    assert res.summary["rejected"] == 0
