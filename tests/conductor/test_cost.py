"""Profiles and the analytic cost model, checked against the seed's own numbers."""

from __future__ import annotations

import pytest

from kvcake.conductor.cost import CostModel
from kvcake.conductor.profiles import (
    HARDWARE_PROFILES,
    MODEL_PROFILES,
    ModelProfile,
    model_profile_from_shape,
    parse_profile,
)


def test_llama3_70b_shape_matches_the_paper() -> None:
    m = MODEL_PROFILES["llama3-70b"]
    assert (m.num_layers, m.hidden_size, m.gqa) == (80, 8192, 8)
    assert m.kv_bytes_per_token == 320 * 1024  # "320 KB of KV per token" in bf16
    assert 70.0e9 < m.num_params < 71.0e9
    assert MODEL_PROFILES["llama3-8b"].kv_bytes_per_token == 128 * 1024


def test_bg_criterion_is_about_6_gbps_on_a800_and_19_on_h800() -> None:
    a800 = CostModel.from_spec("llama3-70b@a800x8-roofline").min_reuse_bandwidth_bytes_per_s(8192)
    h800 = CostModel.from_spec("llama3-70b@h800x8-roofline").min_reuse_bandwidth_bytes_per_s(8192)
    # G * (2d/gqa)*s / (a p d + b d^2) = 8 * 312e12 * 4096 / (26 * 8192^2) exactly.
    assert a800 == pytest.approx(8 * 312e12 * 4096 / (26 * 8192**2))
    assert 5.5e9 < a800 < 6.5e9
    assert 18e9 < h800 < 19.5e9


def test_prefill_flops_formula_and_incremental_prefill() -> None:
    cost = CostModel.from_spec("llama3-70b@a800x8-roofline")
    n, d, layers = 4096, 8192, 80
    assert cost.prefill_flops(n) == pytest.approx(layers * (4 * n * n * d + 22 * n * d * d))
    # With a cached prefix p, tokens p..n attend to all n tokens.
    p = 1024
    assert cost.prefill_flops(n, p) == pytest.approx(layers * (4 * (n - p) * n * d + 22 * (n - p) * d * d))
    assert cost.prefill_flops(n, n) == 0.0
    hw = HARDWARE_PROFILES["a800x8-roofline"]
    assert cost.prefill_time_s(n) == pytest.approx(cost.prefill_flops(n) / (hw.peak_flops * hw.mfu))
    assert cost.predict(n, p) == cost.prefill_time_s(n, p)


def test_decode_step_reads_weights_and_batch_kv() -> None:
    cost = CostModel.from_spec("llama3-70b@a800x8-roofline")
    hw, m = cost.hardware, cost.model
    expected = (m.weight_bytes + 10_000 * m.kv_bytes_per_token) / (
        hw.hbm_bandwidth_bytes_per_s * hw.hbm_efficiency)
    assert cost.decode_step_time_s(4, 10_000) == pytest.approx(expected)
    assert cost.decode_step_time_s(0, 0) == 0.0
    # More context -> slower step; huge batches become compute bound.
    assert cost.decode_step_time_s(4, 20_000) > cost.decode_step_time_s(4, 10_000)
    big = cost.decode_step_time_s(4096, 0)
    assert big == pytest.approx(2 * m.num_params * 4096 / (hw.peak_flops * hw.mfu))


def test_transfer_time() -> None:
    cost = CostModel.from_spec("llama3-8b@h800x8")
    assert cost.transfer_time_s(400 * 10**9) == pytest.approx(1.0)  # 8 x 400 Gbps = 400 GB/s
    assert cost.transfer_time_s(10**9, 1e9) == pytest.approx(1.0)
    assert cost.kv_bytes(3) == 3 * 128 * 1024
    with pytest.raises(ValueError, match="bandwidth"):
        cost.transfer_time_s(1, 0.0)


def test_unknown_profile_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama3-70b, llama3-8b"):
        parse_profile("gpt5@a800x8")
    with pytest.raises(ValueError, match="a800x8, a800x8-roofline, h800x8"):
        parse_profile("llama3-70b@tpu")
    with pytest.raises(ValueError, match="MODEL@HARDWARE"):
        parse_profile("llama3-70b")


def test_profile_from_engine_shape() -> None:
    m = model_profile_from_shape(ModelProfile("tiny", 2, 64, 4, 2, 128, 1000))
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert m.linear_coeff == pytest.approx(2 * m.layer_params / 64**2)
    # For llama3-70b's shape the derived coefficient is close to the paper's 22.
    derived = model_profile_from_shape(ModelProfile("x", 80, 8192, 64, 8, 28672, 128256))
    assert 20 < derived.linear_coeff < 27
    with pytest.raises(ValueError, match="num_heads"):
        ModelProfile("bad", 2, 64, 5, 1, 128, 10)
    with pytest.raises(ValueError, match="num_layers"):
        model_profile_from_shape(ModelProfile("bad", 0, 64, 4, 2, 128, 1000))


def test_calibrated_profile_adds_overheads_attention_and_small_forward_mfu() -> None:
    cost = CostModel.from_spec("llama3-70b@a800x8")
    bare = CostModel.from_spec("llama3-70b@a800x8-roofline")
    hw, m = cost.hardware, cost.model
    assert hw.decode_step_overhead_s > 0 and hw.attention_efficiency < hw.hbm_efficiency
    kv = 10_000 * m.kv_bytes_per_token / (hw.hbm_bandwidth_bytes_per_s * hw.attention_efficiency)
    weights = m.weight_bytes / (hw.hbm_bandwidth_bytes_per_s * hw.hbm_efficiency)
    assert cost.decode_step_time_s(4, 10_000) == pytest.approx(
        weights + kv + hw.decode_step_overhead_s)
    assert cost.decode_step_time_s(4, 10_000) > bare.decode_step_time_s(4, 10_000)
    # MFU falls for small forwards: per token, a 512-token prefill costs more than a 12k one.
    assert hw.mfu_at(512) < hw.mfu_at(12_000) < hw.mfu
    per_token_small = (cost.prefill_time_s(512) - hw.prefill_step_overhead_s) / 512
    assert per_token_small > cost.prefill_flops(512) / 512 / (hw.peak_flops * hw.mfu)
    # Figure 8's calibration point: a 512-token chunk's compute costs ~1.22x a 12k prompt's.
    whole = cost.prefill_time_s(12_000) - hw.prefill_step_overhead_s
    chunks = cost.chunk_compute_s(12_000, 0, 512, 512) * 12_000 / 512
    assert 1.15 < chunks / whole < 1.3
    assert cost.prefill_time_s(100, 100) == 0.0


def test_cpp_prefill_takes_about_chunks_plus_nodes_minus_one_stages() -> None:
    cost = CostModel.from_spec("llama3-70b@a800x8")
    n = 128_000
    one = cost.cpp_prefill_time_s(n, 0, 1, 2000)
    four = cost.cpp_prefill_time_s(n, 0, 4, 2000)
    assert four == pytest.approx(one * (64 + 3) / (64 * 4))
    assert four < cost.prefill_time_s(n) / 3  # a 128k prompt: ~4x faster on 4 nodes
