"""The mean of two live profiles: it predicts the mean of their predictions; what fixes a fit's
basis or the shape must match, and a mismatch is refused by its path."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcake.conductor import DecodePoint, DecodeStepPredictor, PrefillPoint, PrefillTimePredictor
from kvcake.sim.live_profile import live_cost_from_dict
from kvcake.sim.profile_mean import mean_profile

SHAPE = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
         "intermediate_size": 1408, "vocab_size": 32000}


def profile(speed: float, prefill_factor: float) -> dict[str, Any]:
    """A profile of a host `speed` times slower than the base one."""
    prefill = PrefillTimePredictor.fit([
        PrefillPoint(n, p, speed * (1e-3 + n * 5e-4 + n * n * 1e-8 - p * 4e-4))
        for n in (128, 512, 1024, 2048) for p in (0, n // 2, 9 * n // 10)])
    decode = DecodeStepPredictor.fit([DecodePoint(b, b * c, speed * (0.004 + 0.001 * b + 1e-7 * b * c))
                                      for b in (1, 8) for c in (256, 2048)])
    live = {"transfer_bandwidth_bytes_per_s": 2e9, "kv_pool_tokens": 65536, "shape": dict(SHAPE),
            "dtype_bytes": 4, "contention": {"decode": 1.0, "prefill": prefill_factor},
            "decode_step_overhead_s": 0.0004 * speed}
    return {"prefill": json.loads(prefill.to_json()), "decode": json.loads(decode.to_json()),
            "prefill_points": [[512, 0, 0.25 * speed]], "live": live}


def test_the_mean_profile_predicts_the_mean_of_the_two() -> None:
    before, after = profile(1.0, 1.2), profile(0.8, 1.0)
    mean = mean_profile(before, after)
    a, b, m = (live_cost_from_dict(x) for x in (before, after, mean))
    for n, p in ((300, 0), (1500, 700), (2000, 1900)):
        iso = (a.prefill.predict(n, p) + b.prefill.predict(n, p)) / 2
        assert m.prefill.predict(n, p) == pytest.approx(iso, rel=1e-9)
    for batch, context in ((1, 300), (8, 9000)):
        iso = (a.decode.decode_step_time_s(batch, context)
               + b.decode.decode_step_time_s(batch, context)) / 2
        assert m.decode.decode_step_time_s(batch, context) == pytest.approx(iso, rel=1e-9)
    assert m.prefill_contention == pytest.approx(1.1)
    assert mean["live"]["decode_step_overhead_s"] == pytest.approx(0.00036)
    assert mean["prefill_points"] == [[512, 0, pytest.approx(0.225)]]  # the grid kept
    assert mean["live"]["shape"] == SHAPE and mean["live"]["kv_pool_tokens"] == 65536
    assert mean["prefill"]["scale"] == before["prefill"]["scale"]


@pytest.mark.parametrize(("edit", "path"), [
    (lambda p: p["prefill"].update(scale=4096.0), "profile.prefill.scale"),
    (lambda p: p["live"]["shape"].update(num_layers=8), "profile.live.shape.num_layers"),
    (lambda p: p["live"]["contention"].pop("prefill"), "profile.live.contention"),
    (lambda p: p["prefill_points"].append([1024, 0, 0.5]), "profile.prefill_points"),
    (lambda p: p["decode"].update(kind="decode_roofline"), "profile.decode.kind"),
])
def test_profiles_measured_differently_are_refused_by_path(edit: Any, path: str) -> None:
    before, after = profile(1.0, 1.2), profile(0.8, 1.0)
    edit(after)
    with pytest.raises(ValueError, match=path.replace(".", r"\.").replace("[", r"\[")):
        mean_profile(before, after)
