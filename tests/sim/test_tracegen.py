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
