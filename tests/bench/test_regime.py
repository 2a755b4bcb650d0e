"""The live capacity experiment's regime, derived from measured step models (pure functions)."""

from __future__ import annotations

import pytest

from kvcake.bench.capacity import find_capacities
from kvcake.bench.regime import (
    PREFILL_STEPS,
    Regime,
    Replay,
    derive_regime,
    solve_prompt_len,
    tbt_slos_ms,
    token_scale,
    ttft_slo_s,
    typical_decode_batch,
)


def test_slos_are_the_papers_ratios() -> None:
    assert tbt_slos_ms(0.010) == pytest.approx((22.0, 44.0, 66.0))
    assert ttft_slo_s(0.5) == pytest.approx(10.5)
    # the paper's own numbers come back: 45 ms steps -> ~100/200/300 ms; 1.44 s -> ~30 s
    assert tbt_slos_ms(0.045) == pytest.approx((99.0, 198.0, 297.0))
    assert ttft_slo_s(1.44) == pytest.approx(30.24)
    with pytest.raises(ValueError, match="s_d"):
        tbt_slos_ms(0.0)


def test_typical_batch_is_littles_law() -> None:
    assert typical_decode_batch(337.0) == 8  # 0.75 * 337 / 32 = 7.9
    assert typical_decode_batch(343.0, utilisation=1.0) == 11
    assert typical_decode_batch(1.0) == 1
    with pytest.raises(ValueError, match="utilisation"):
        typical_decode_batch(100.0, utilisation=1.5)


def test_solve_prompt_len_and_scale() -> None:
    def linear(n: int) -> float:
        return n / 2000.0  # 2,000 tokens/s

    assert solve_prompt_len(linear, 0.32, 30000) == 640
    assert solve_prompt_len(linear, 100.0, 30000) == 30000  # capped at the context
    quadratic = lambda n: n / 2000.0 + (n / 20000.0) ** 2  # noqa: E731
    n = solve_prompt_len(quadratic, 1.0, 30000)
    assert quadratic(n) <= 1.0 < quadratic(n + 1)
    assert token_scale(640, 12800.0) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="mean_input_len"):
        token_scale(640, 0.0)


def test_derive_regime_fixed_point() -> None:
    def step(batch: int, context: int) -> float:
        return 0.004 + 0.0005 * batch + 1e-7 * context

    def prefill(n: int) -> float:
        return n / 2000.0

    outputs = [500, 3000, 10, 300]  # 3000 is capped at 1,024
    regime = derive_regime(step, prefill, Replay(12000.0, outputs, num_requests=40, max_probes=4),
                           max_model_len=32768)
    mean_out = (500 + 1024 + 10 + 300) / 4
    assert regime.mean_output_len == pytest.approx(mean_out)
    assert regime.decode_batch == typical_decode_batch(mean_out)
    context = regime.target_prompt_len + -(-mean_out // 2)
    assert regime.s_d_s == pytest.approx(step(regime.decode_batch,
                                              regime.decode_batch * context))
    # the mean prompt's cold prefill is 32 decode steps (to one token)
    assert abs(prefill(regime.target_prompt_len) - PREFILL_STEPS * regime.s_d_s) <= 1 / 2000
    assert regime.scale_tokens == pytest.approx(regime.target_prompt_len / 12000.0)
    assert regime.tbt_slos_ms == pytest.approx(tbt_slos_ms(regime.s_d_s))
    assert regime.ttft_slo_s == pytest.approx(21 * regime.mean_prefill_s)
    assert regime.max_prompt_len == 32768 - 1024
    assert Regime.from_json(regime.to_json()) == regime


def test_derive_regime_caps_at_the_context() -> None:
    regime = derive_regime(lambda b, c: 1.0, lambda n: n * 1e-6, Replay(1000.0, [100], 10, 1), 4096)
    assert regime.target_prompt_len == 4096 - 1024
    with pytest.raises(ValueError, match="no room"):
        derive_regime(lambda b, c: 1.0, lambda n: n, Replay(1000.0, [100], 10, 1), 1024)


def test_regime_file_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="--measure-regime"):
        Regime.from_json('{"s_d_s": 0.01}')


def test_find_capacities_shares_replays_between_slos() -> None:
    knees = (2.0, 5.0, 9.0)  # a looser SLO holds to a higher speed
    calls: list[float] = []

    def probe(speed: float) -> list[float]:
        calls.append(speed)
        return [1.0 if speed <= k else 0.0 for k in knees]

    found = find_capacities(probe, 1.0, 3, max_probes=8, rel_tol=0.05)
    assert len(calls) == len(set(calls)) == len(found.probes)  # no speed replayed twice
    for best, knee in zip(found.best_speeds, knees, strict=True):
        assert best is not None and knee / 1.05 <= best <= knee
    assert found.best_speeds[0] <= found.best_speeds[1] <= found.best_speeds[2]
    nothing = find_capacities(lambda s: [0.0, 0.0], 1.0, 2, max_probes=2)
    assert nothing.best_speeds == (None, None)
    with pytest.raises(ValueError, match="shares"):
        find_capacities(lambda s: [1.0], 1.0, 2)
