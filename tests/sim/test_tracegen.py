"""Seeded trace generator: determinism, format validity, conversation-like structure."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcake.sim.trace import load_trace
from kvcake.sim.tracegen import TraceGenConfig, generate_trace


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    cfg = TraceGenConfig(num_requests=300, seed=11)
    generate_trace(cfg).write(tmp_path / "a.jsonl")
    generate_trace(cfg).write(tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    generate_trace(TraceGenConfig(num_requests=300, seed=12)).write(tmp_path / "c.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


def test_output_passes_validation_and_looks_like_conversation(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    generate_trace(TraceGenConfig(num_requests=2000, seed=1)).write(path)
    stats = load_trace(path).stats()
    assert stats.num_requests == 2000
    assert 7000 < stats.mean_input_len < 16000
    assert 0.25 < stats.reusable_share < 0.6
    assert stats.arrival_rate_per_s == pytest.approx(3.4, rel=0.1)


def test_sessions_and_system_prompts_share_prefixes() -> None:
    trace = generate_trace(TraceGenConfig(num_requests=200, seed=2, num_system_prompts=1,
                                          system_prompt_len=1024, block_size=512))
    firsts = {r.hash_ids[:2] for r in trace.requests}
    assert firsts == {(0, 1)}  # the one system prompt's two full blocks start every prompt
    # Some request extends an earlier one's full blocks beyond the system prompt (a later turn).
    prefixes = {r.hash_ids[: r.input_len // 512] for r in trace.requests}
    assert any(len(p) > 2 and r.hash_ids[: len(p)] == p and r.hash_ids != p
               for r in trace.requests for p in prefixes)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="unknown trace generator keys"):
        TraceGenConfig.from_dict({"requests": 5})
    with pytest.raises(ValueError, match="rate_per_s"):
        TraceGenConfig(rate_per_s=0)
    with pytest.raises(ValueError, match="new_session_prob"):
        TraceGenConfig(new_session_prob=0)


def _mmpp(**kw: float) -> TraceGenConfig:
    return TraceGenConfig(**{"num_requests": 8000, "rate_per_s": 100.0, "seed": 3,
                             "burst_rate_factor": 2.5, "burst_mean_s": 0.05, "calm_mean_s": 0.15,
                             "system_prompt_len": 512, "mean_first_message_len": 200,
                             "mean_followup_len": 50, **kw})


def test_calm_rate_keeps_the_mean_rate_and_bad_bursts_are_refused() -> None:
    cfg = _mmpp()
    assert cfg.burst_share == pytest.approx(0.25)
    assert cfg.calm_rate_factor == pytest.approx(0.5)  # 0.25 x 2.5 + 0.75 x 0.5 = 1
    with pytest.raises(ValueError, match="calm rate would be negative"):
        _mmpp(burst_rate_factor=5.0)
    with pytest.raises(ValueError, match="burst_rate_factor must be >= 1"):
        _mmpp(burst_rate_factor=0.5)
    with pytest.raises(ValueError, match="burst_mean_s and calm_mean_s"):
        _mmpp(calm_mean_s=0.0)


def test_the_modulated_clock_integrates_the_rate_across_state_changes() -> None:
    from kvcake.sim.tracegen import _Modulation

    m = _Modulation(TraceGenConfig(rate_per_s=10.0, burst_rate_factor=2.0, burst_mean_s=1.0,
                                   calm_mean_s=3.0))
    m.burst, m.ends_s = True, 1.0
    m._duration = lambda: 100.0  # type: ignore[method-assign]
    assert m.advance(0.0, 10.0) == pytest.approx(0.5)  # 10 units at 20/s
    # 20 more units: 10 left of the burst (to t=1), then 10 at the calm 10 x 2/3 per s.
    assert m.advance(0.5, 20.0) == pytest.approx(2.5)
    assert not m.burst and m.ends_s == pytest.approx(101.0)


def test_mmpp_is_seeded_keeps_the_requests_and_the_mean_rate_and_bunches_arrivals() -> None:
    a, b = generate_trace(_mmpp()), generate_trace(_mmpp())
    assert a.requests == b.requests
    assert generate_trace(_mmpp(seed=4)).requests != a.requests
    poisson = generate_trace(_mmpp(burst_rate_factor=1.0))
    # Same lengths and block ids as the Poisson trace of the seed: only the times differ.
    assert [(r.input_len, r.output_len, r.hash_ids) for r in a.requests] == [
        (r.input_len, r.output_len, r.hash_ids) for r in poisson.requests]
    assert [r.timestamp_ms for r in a.requests] != [r.timestamp_ms for r in poisson.requests]
    assert a.stats().arrival_rate_per_s == pytest.approx(100.0, rel=0.06)

    def dispersion(trace: object) -> float:  # variance / mean of arrivals per 50 ms window
        counts: dict[int, int] = {}
        for r in trace.requests:  # type: ignore[attr-defined]
            counts[int(r.timestamp_ms // 50)] = counts.get(int(r.timestamp_ms // 50), 0) + 1
        n = max(counts) + 1
        mean = sum(counts.values()) / n
        return sum((counts.get(i, 0) - mean) ** 2 for i in range(n)) / n / mean

    assert dispersion(poisson) < 1.3 < 2.0 < dispersion(a)


def test_factor_one_is_the_plain_poisson_trace_whatever_the_burst_settings() -> None:
    plain = generate_trace(TraceGenConfig(num_requests=300, seed=5))
    assert generate_trace(TraceGenConfig(num_requests=300, seed=5, burst_mean_s=7.0,
                                         calm_mean_s=9.0)).requests == plain.requests


def test_output_bursts_lengthen_only_the_outputs_of_requests_arriving_in_a_burst() -> None:
    cfg = _mmpp(num_requests=4000, burst_rate_factor=1.0, burst_output_factor=3.0)
    plain = generate_trace(_mmpp(num_requests=4000, burst_rate_factor=1.0))
    bursty = generate_trace(cfg)
    assert generate_trace(cfg).requests == bursty.requests
    # Each output is the plain trace's draw, or that draw at 3x the mean (+-1 for rounding).
    hot = []
    for b, p in zip(bursty.requests, plain.requests, strict=True):
        assert b.output_len == p.output_len or abs(b.output_len - 3 * p.output_len) <= 2
        hot.append(b.output_len != p.output_len)
    assert 0.2 < sum(hot) / len(hot) < 0.3  # the burst share, 0.25
    runs = sum(1 for a, b in zip(hot, hot[1:], strict=False) if a != b)
    # In runs: ~2 switches per 0.2 s cycle (~400 in 40 s), where independent draws at the
    # same share would switch 2 x 0.25 x 0.75 x 4,000 = 1,500 times.
    assert runs < 750
    with pytest.raises(ValueError, match="burst_output_factor must be >= 1"):
        _mmpp(burst_output_factor=0.5)
