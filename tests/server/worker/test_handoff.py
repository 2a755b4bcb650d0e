"""The prefill worker's per-request choice of KV hand-off (layer-wise or after the prefill)."""

from __future__ import annotations

import pytest

from kvcake.server.worker.handoff import MIN_SAMPLE_BYTES, HandoffPolicy

MIB = 2**20


def test_measures_first_then_chooses_by_predicted_transfer_time() -> None:
    policy = HandoffPolicy(min_transfer_s=0.010, probe_every=100)
    assert not policy.layerwise(100 * MIB)  # nothing measured: after the prefill, timed
    policy.observe(3 * MIB, 0.0015)  # a fast same-host link: 2 MiB/ms
    assert policy.bandwidth_bytes_per_s == pytest.approx(3 * MIB / 0.0015)
    assert not policy.layerwise(6 * MIB)  # 3 ms < 10 ms: not worth the hook
    assert policy.layerwise(40 * MIB)  # 20 ms: stream it
    policy.observe(10 * MIB, 1.0)  # the link got slow (10 MiB/s): the EWMA follows
    assert policy.bandwidth_bytes_per_s < 3 * MIB / 0.0015
    for _ in range(20):
        policy.observe(10 * MIB, 1.0)
    assert policy.layerwise(1 * MIB)  # ~100 ms now


def test_tiny_or_untimed_handoffs_are_not_samples() -> None:
    policy = HandoffPolicy()
    policy.observe(MIN_SAMPLE_BYTES - 1, 1e-6)
    policy.observe(10 * MIB, 0.0)
    assert policy.bandwidth_bytes_per_s is None


def test_probes_the_link_while_streaming() -> None:
    policy = HandoffPolicy(min_transfer_s=0.0, probe_every=4)
    policy.observe(MIB, 0.001)
    choices = [policy.layerwise(MIB) for _ in range(8)]
    assert choices == [True, True, True, False, True, True, True, False]
    with pytest.raises(ValueError, match="probe_every"):
        HandoffPolicy(probe_every=0)
