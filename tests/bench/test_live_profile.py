"""`kvcake simulate --live-profile`: the simulator driven by costs fitted on the live engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcake.conductor import DecodePoint, DecodeStepPredictor, PrefillPoint, PrefillTimePredictor
from kvcake.sim.config import SimConfig
from kvcake.sim.live_profile import live_cost_from_dict, load_live_profile
from kvcake.sim.run import simulate
from kvcake.sim.trace import Trace, TraceRequest

SHAPE = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
         "intermediate_size": 1408, "vocab_size": 32000}


def profile_dict(bandwidth: float = 2e9, pool_tokens: int = 65536) -> dict[str, object]:
    prefill = PrefillTimePredictor.fit([PrefillPoint(n, p, 1e-3 + n * 5e-4 - p * 4e-4)
                                        for n in (128, 512, 1024, 2048)
                                        for p in (0, n // 2, 9 * n // 10)])
    decode = DecodeStepPredictor.fit([DecodePoint(b, b * c, 0.004 + 0.001 * b + 1e-7 * b * c)
                                      for b in (1, 8) for c in (256, 2048)])
    return {"model": "m44", "dtype": "float32", "num_threads": 1,
            "prefill": json.loads(prefill.to_json()), "decode": json.loads(decode.to_json()),
            "prefill_points": [], "decode_points": [],
            "live": {"transfer_bandwidth_bytes_per_s": bandwidth, "kv_pool_tokens": pool_tokens,
                     "shape": SHAPE, "dtype_bytes": 4,
                     "topology": {"num_prefill": 1, "num_decode": 1}}}


def test_costs_come_from_the_fits(tmp_path: Path) -> None:
    path = tmp_path / "live.json"
    path.write_text(json.dumps(profile_dict()))
    cost = load_live_profile(path)
    assert cost.model.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4  # K+V, 4 layers, fp32
    assert cost.prefill_time_s(1024) == pytest.approx(1e-3 + 1024 * 5e-4, rel=1e-3)
    assert cost.prefill_time_s(1024, 1024) == 0.0
    half = cost.prefill_time_s(1024, 0) * 256 / 1024
    assert cost.chunk_compute_s(1024, 0, 256, 2048) == pytest.approx(half)
    assert cost.decode_step_time_s(8, 8 * 1000) == pytest.approx(0.004 + 0.008 + 8e-4, rel=1e-6)
    assert cost.decode_step_time_s(0, 0) == 0.0
    assert cost.transfer_time_s(4 * 10**9) == pytest.approx(2.0)
    # the simulator's decode KV capacity is the live pool, its prefill cache too
    hw, model = cost.hardware, cost.model  # as kvcake/sim/topology.py sizes a decode node
    assert int((hw.hbm_bytes * 0.9 - model.weight_bytes) // model.kv_bytes_per_token) == 65536
    assert cost.hardware.dram_bytes // cost.model.kv_bytes_per_token == 65536
    assert dict(cost.topology) == {"num_prefill": 1, "num_decode": 1}


def test_bad_files_say_what_is_missing(tmp_path: Path) -> None:
    data = profile_dict()
    del data["live"]
    with pytest.raises(ValueError, match="missing 'live'"):
        live_cost_from_dict(data)
    with pytest.raises(ValueError, match="must be > 0"):
        live_cost_from_dict(profile_dict(bandwidth=0.0))
    (tmp_path / "x.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_live_profile(tmp_path / "x.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_live_profile(tmp_path / "absent.json")


def test_simulate_runs_on_a_live_profile() -> None:
    cost = live_cost_from_dict(profile_dict()).as_cost_model()
    requests = tuple(TraceRequest(i, 500.0 * i, 64, 20, (0, 1 + i)) for i in range(6))
    trace = Trace(requests, "test", block_size=32)
    fast = simulate(SimConfig(num_prefill=1, num_decode=1, policy="global_cache",
                              block_size=32, admission="none"), trace, cost)
    assert fast.summary["completed"] == 6
    slow_profile = profile_dict()
    slow_profile["decode"] = {"kind": "decode_linear", "coeffs": [0.04, 0.0, 0.0]}
    slow = simulate(SimConfig(num_prefill=1, num_decode=1, policy="global_cache",
                              block_size=32, admission="none"), trace,
                    live_cost_from_dict(slow_profile).as_cost_model())
    assert slow.summary["tbt_s"]["p50"] > fast.summary["tbt_s"]["p50"]
