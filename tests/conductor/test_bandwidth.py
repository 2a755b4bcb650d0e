"""The bandwidth estimate from measured transfers, and the fetch/recompute choice it drives.

Models as in test_conductor: prefill_s = (n - p) / 1000, 1000 KV bytes per token. A 200-token
prompt whose first 192 tokens (12 blocks) sit in the store: recomputing takes 0.2 s, fetching
192,000 bytes / B + 0.008 s, so fetching pays while B > ~1.0e6 bytes/s.
"""

from __future__ import annotations

import pytest

from kvcake.conductor import Conductor, ConductorConfig, Placement, ScheduleRequest
from kvcake.conductor.bandwidth import BandwidthEstimator
from tests.conductor.test_conductor import BS, DECODE, PREFILL


def test_first_measurement_replaces_the_prior_then_ewma() -> None:
    est = BandwidthEstimator(100e9, weight=0.5, min_bytes=1000)
    assert est.bytes_per_s == 100e9 and est.num_samples == 0
    assert est.observe(1_000_000, 0.1)  # 1e7 B/s
    assert est.bytes_per_s == pytest.approx(1e7)
    assert est.observe(1_000_000, 1.0)  # 1e6 B/s: halfway
    assert est.bytes_per_s == pytest.approx(5.5e6)
    assert est.num_samples == 2


def test_small_or_instant_transfers_are_not_measurements() -> None:
    est = BandwidthEstimator(1e7, weight=1.0, min_bytes=1000)
    assert not est.observe(999, 1.0)
    assert not est.observe(0, 0.0)
    assert not est.observe(5000, 0.0)
    assert est.bytes_per_s == 1e7 and est.num_samples == 0
    assert est.observe(1000, 1.0)
    assert est.bytes_per_s == pytest.approx(1000.0)
    est.reset(2e6)
    assert est.bytes_per_s == 2e6 and est.num_samples == 0


@pytest.mark.parametrize("bad", [dict(prior_bytes_per_s=0.0), dict(weight=0.0),
                                 dict(weight=1.5), dict(min_bytes=-1)])
def test_bad_settings_are_refused(bad: dict[str, float]) -> None:
    settings: dict[str, float] = dict(prior_bytes_per_s=1e7, weight=0.5, min_bytes=0)
    settings.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        BandwidthEstimator(**settings)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_bytes"):
        BandwidthEstimator(1e7).observe(-1, 1.0)


def test_config_checks_the_estimator_settings() -> None:
    with pytest.raises(ValueError, match="measured_bandwidth_weight"):
        ConductorConfig(measured_bandwidth_weight=0.0)
    with pytest.raises(ValueError, match="min_measured_bytes"):
        ConductorConfig(min_measured_bytes=-1)


def _conductor() -> Conductor:
    config = ConductorConfig(transfer_bandwidth_bytes_per_s=1e7, fetch_only_if_faster=True,
                             measured_bandwidth_weight=0.5, min_measured_bytes=1 << 16,
                             ttft_slo_s=30.0, tbt_slo_s=1.0)
    conductor = Conductor(config, ["p0"], ["d0"], PREFILL, DECODE, 1000)
    conductor.on_blocks_stored("store", list(range(12)))
    return conductor


def _choice(conductor: Conductor, rid: str) -> str:
    decision = conductor.schedule(ScheduleRequest(rid, 200, tuple(range(12)), BS, 10), 0.0)
    assert isinstance(decision, Placement), decision
    conductor.on_request_aborted(rid)  # forget the booking: every call sees the same cluster
    if decision.fetch is None:
        return "recompute"
    assert decision.fetch.source == "store" and decision.fetch.num_bytes == 192_000
    assert decision.fetch.transfer_s == pytest.approx(192_000 / conductor.transfer_bandwidth)
    return "fetch"


def test_conductor_switches_to_recompute_as_measured_bandwidth_drops() -> None:
    conductor = _conductor()
    assert _choice(conductor, "r0") == "fetch"  # the prior, 1e7 B/s
    assert conductor.on_transfer_measured(1_000_000, 0.1)  # 1e7 B/s measured
    assert _choice(conductor, "r1") == "fetch"
    expected = [5.05e6, 2.575e6, 1.3375e6, 0.71875e6]  # 1e5 B/s measured, folded in by halves
    choices = []
    for i, estimate in enumerate(expected):
        assert conductor.on_transfer_measured(1_000_000, 10.0)
        assert conductor.transfer_bandwidth == pytest.approx(estimate)
        choices.append(_choice(conductor, f"s{i}"))
    assert choices == ["fetch", "fetch", "fetch", "recompute"]
    assert not conductor.on_transfer_measured(1000, 10.0)  # too small: no change
    assert _choice(conductor, "t") == "recompute"
    for _ in range(3):  # the link recovers: 1e8 B/s measured
        conductor.on_transfer_measured(10_000_000, 0.1)
    assert _choice(conductor, "u") == "fetch"


def test_set_transfer_bandwidth_restarts_the_estimate() -> None:
    conductor = _conductor()
    conductor.on_transfer_measured(1_000_000, 10.0)
    assert _choice(conductor, "a") == "recompute"
    conductor.set_transfer_bandwidth(2e7)
    assert conductor.bandwidth.num_samples == 0
    assert _choice(conductor, "b") == "fetch"
    conductor.on_transfer_measured(1_000_000, 10.0)  # the first since the reset replaces it
    assert conductor.transfer_bandwidth == pytest.approx(1e5)
