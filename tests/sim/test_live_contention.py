"""The live profile's per-host contention factors: every decode step and every prefill of the
simulator take that many times the isolated fit; absent, nothing changes; bad values are refused
by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcake.conductor import DecodePoint, DecodeStepPredictor, PrefillPoint, PrefillTimePredictor
from kvcake.sim.config import SimConfig
from kvcake.sim.live_profile import live_cost_from_dict
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace, TraceRequest

SHAPE = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
         "intermediate_size": 1408, "vocab_size": 32000}


def profile(contention: Any = None) -> dict[str, Any]:
    prefill = PrefillTimePredictor.fit([PrefillPoint(n, p, 1e-3 + n * 5e-4 - p * 4e-4)
                                        for n in (128, 512, 1024, 2048)
                                        for p in (0, n // 2, 9 * n // 10)])
    decode = DecodeStepPredictor.fit([DecodePoint(b, b * c, 0.004 + 0.001 * b + 1e-7 * b * c)
                                      for b in (1, 8) for c in (256, 2048)])
    live: dict[str, Any] = {"transfer_bandwidth_bytes_per_s": 2e9, "kv_pool_tokens": 65536,
                            "shape": SHAPE, "dtype_bytes": 4}
    if contention is not None:
        live["contention"] = contention
    return {"prefill": json.loads(prefill.to_json()), "decode": json.loads(decode.to_json()),
            "live": live}


def test_factors_multiply_decode_steps_and_prefills() -> None:
    plain = live_cost_from_dict(profile())
    slowed = live_cost_from_dict(profile({"decode": 2.0, "prefill": 1.5}))
    assert (plain.decode_contention, plain.prefill_contention) == (1.0, 1.0)
    assert slowed.decode_step_time_s(8, 8000) == pytest.approx(2.0 * plain.decode_step_time_s(8, 8000))
    assert slowed.prefill_time_s(1024, 256) == pytest.approx(1.5 * plain.prefill_time_s(1024, 256))
    # a chunk is its share of the (slowed) prefill; CPP's pipelined time too
    assert slowed.chunk_compute_s(1024, 0, 256, 512) == pytest.approx(
        1.5 * plain.chunk_compute_s(1024, 0, 256, 512))
    assert slowed.cpp_prefill_time_s(2048, 0, 2, 512) == pytest.approx(
        1.5 * plain.cpp_prefill_time_s(2048, 0, 2, 512))
    only_decode = live_cost_from_dict(profile({"decode": 3.0}))
    assert only_decode.prefill_time_s(1024) == pytest.approx(plain.prefill_time_s(1024))


@pytest.mark.parametrize(("contention", "error"), [
    ({"decode": 0.0}, "decode must be a positive finite factor"),
    ({"prefill": -1.0}, "prefill must be a positive finite factor"),
    ({"decode": float("inf")}, "decode must be a positive finite factor"),
    ({"network": 2.0}, "live.contention: expected"),
    ([2.0], "live.contention: expected"),
])
def test_bad_factors_are_refused_by_name(contention: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        live_cost_from_dict(profile(contention))


def test_the_simulator_slows_with_the_decode_factor() -> None:
    requests = tuple(TraceRequest(i, 500.0 * i, 64, 20, (0, 1 + i)) for i in range(6))
    trace = Trace(requests, "test", block_size=32)
    config = SimConfig(num_prefill=1, num_decode=1, policy="global_cache", block_size=32,
                       admission="none")
    tbt = [simulate(config, trace, live_cost_from_dict(profile({"decode": f})).as_cost_model())
           .summary["tbt_s"]["p50"] for f in (1.0, 2.0)]
    assert tbt[1] == pytest.approx(2.0 * tbt[0], rel=0.05)


def test_live_profile_fit_fits_a_factor_by_bisection() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import live_profile_fit

    def measure(f: float) -> float:  # a simulated metric that grows with the factor
        return 40.0 * f + 10.0

    assert live_profile_fit.fit_factor(90.0, measure) == pytest.approx(2.0, rel=1e-3)
    assert live_profile_fit.fit_factor(1.0, measure) == 0.5  # below the range: its lower bound
    assert live_profile_fit.fit_factor(1e6, measure) == 8.0  # above it: the upper bound
