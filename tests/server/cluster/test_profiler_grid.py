"""The profile's default grid spans the engine's prompts, and an older cache is measured again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.profiler import (
    PROFILE_FORMAT,
    Profile,
    ProfileGrid,
    cache_path,
    load_or_profile,
)


def test_spanning_doubles_up_to_the_longest_prompt_the_engine_takes() -> None:
    grid = ProfileGrid.spanning(max_prompt_tokens=32767, kv_pool_tokens=262144)
    assert grid.input_lens == (32, 96, 192, 384, 768, 1536, 3072, 6144, 8192)
    assert grid.decode_context_lens == (32, 256, 2048)
    assert grid.prefix_fracs == ProfileGrid().prefix_fracs


def test_spanning_stops_at_the_context_and_at_the_kv_pool() -> None:
    tiny = ProfileGrid.spanning(max_prompt_tokens=2047, kv_pool_tokens=4096)
    assert tiny.input_lens == (32, 96, 192, 384, 768, 1536, 2047)
    assert tiny.decode_context_lens == (32, 256)  # 8 sequences x 256 = half the pool
    big_pool = ProfileGrid.spanning(max_prompt_tokens=2047, kv_pool_tokens=2**20)
    assert big_pool.decode_context_lens == (32, 256, 1023)  # half the context: room to generate
    small_pool = ProfileGrid.spanning(max_prompt_tokens=8191, kv_pool_tokens=1000)
    assert small_pool.input_lens == (32, 96, 192, 384, 768, 999)
    assert small_pool.decode_context_lens == (32, 62)


def test_spanning_a_short_context_still_gives_three_lengths() -> None:
    assert ProfileGrid.spanning(max_prompt_tokens=40, kv_pool_tokens=4096).input_lens == (
        10, 20, 40)


def test_an_older_cache_is_measured_again_with_the_default_grid(tmp_path: Path) -> None:
    engine = EngineConfig(kv_cache_bytes=8 * 2**20, max_num_batched_tokens=128)
    explicit = ProfileGrid(input_lens=(16, 48, 96), decode_batch_sizes=(1, 2),
                           decode_context_lens=(32, 64), repeats=1)
    first = load_or_profile("tiny", engine, tmp_path, explicit, num_threads=1)
    path = cache_path(tmp_path, "tiny", "float32", 1, 128)
    raw = json.loads(path.read_text())
    assert raw["format"] == PROFILE_FORMAT
    del raw["format"]  # as written before the format existed: prompts of <= 384 tokens
    path.write_text(json.dumps(raw))
    assert Profile.from_json(path.read_text()).format == 1
    # An explicit grid takes the cache as it is; the default grid measures it again.
    again = load_or_profile("tiny", engine, tmp_path, explicit, num_threads=1)
    assert again.prefill_points == first.prefill_points
    fresh = load_or_profile("tiny", engine, tmp_path, num_threads=1)
    assert fresh.format == PROFILE_FORMAT
    assert max(p.input_len for p in fresh.prefill_points) == 2047  # tiny: 2,048-token context
    assert Profile.from_json(path.read_text()).prefill_points == fresh.prefill_points


def test_each_step_token_budget_is_profiled_and_cached_apart(tmp_path: Path) -> None:
    """A colocated worker prefills in chunks of its budget: its Conductor's profile is
    measured at that budget, never taken from another budget's cache."""
    grid = ProfileGrid(input_lens=(16, 48, 96), decode_batch_sizes=(1, 2),
                       decode_context_lens=(32, 64), repeats=1)
    default = EngineConfig(kv_cache_bytes=8 * 2**20)
    small = EngineConfig(kv_cache_bytes=8 * 2**20, max_num_batched_tokens=32)
    load_or_profile("tiny", default, tmp_path, grid, num_threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile-tiny-float32-t1.json"]
    steps: list[int] = []
    from kvcake.engine import engine as engine_module

    step = engine_module.Engine.step

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        steps.append(self.config.max_num_batched_tokens)
        return step(self, *args, **kwargs)

    engine_module.Engine.step = counting  # type: ignore[method-assign]
    try:
        load_or_profile("tiny", small, tmp_path, grid, num_threads=1)
    finally:
        engine_module.Engine.step = step  # type: ignore[method-assign]
    assert steps and set(steps) == {32}  # measured again, at its own budget
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "profile-tiny-float32-t1-b32.json", "profile-tiny-float32-t1.json"]


@pytest.mark.parametrize("bad", [(1, 2, 3), (16, 48)])
def test_a_grid_of_too_few_or_too_short_prompts_is_refused(bad: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="input_lens: give at least 3 lengths, each >= 2"):
        ProfileGrid(input_lens=bad)


def test_a_timed_grid_stops_doubling_after_a_slow_prefill_and_keeps_decode_batches_short(
        ) -> None:
    """A model too slow for the spanning grid's long prompts measures 3 lengths (a budget any
    prefill passes), and no decode batch holding more prompt tokens than the longest of them."""
    from kvcake.engine.engine import Engine
    from kvcake.server.cluster.profiler import measure_decode, measure_prefill

    engine = Engine("tiny", EngineConfig(kv_cache_bytes=8 * 2**20, max_num_batched_tokens=128))
    grid = ProfileGrid(input_lens=(16, 48, 96, 192, 384), prefix_fracs=(0.0, 0.5),
                       decode_batch_sizes=(1, 4), decode_context_lens=(16, 64), repeats=1,
                       longest_prefill_s=1e-9)
    points = measure_prefill(engine, grid)
    assert sorted({p.input_len for p in points}) == [16, 48, 96]
    decode = measure_decode(engine, grid, max_batch_tokens=96)
    # (batch, its context tokens in all): 4 x 64 = 256 prompt tokens is over the 96 measured
    assert [(d.batch_size, d.context_tokens) for d in decode] == [(1, 16), (1, 64), (4, 64)]
    assert ProfileGrid.spanning(2047, 4096).longest_prefill_s == 2.0


def test_a_grid_refuses_a_prefill_budget_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="longest_prefill_s: must be > 0 seconds or None"):
        ProfileGrid(longest_prefill_s=0.0)
