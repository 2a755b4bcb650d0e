"""`measure_decode` times steps of the batch it reports: every request of the point still runs."""

from __future__ import annotations

import torch

from kvcake.engine.config import EngineConfig
from kvcake.engine.engine import Engine
from kvcake.server.cluster.profiler import ProfileGrid, measure_decode


def test_each_timed_step_runs_the_whole_batch() -> None:
    torch.manual_seed(0)
    # 4 prompts of 200 tokens over a 128-token budget: the prefill takes several steps, and
    # the requests prefilled first decode meanwhile (before the fix they had finished by the
    # time the last prompt was computed, so the timed steps ran 1-2 sequences, not 4).
    engine = Engine("tiny", EngineConfig(max_num_batched_tokens=128, kv_cache_bytes=8 << 20))
    running_at_step: list[int] = []
    timed: list[int] = []
    step, abort = engine.step, engine.abort

    def spy_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        running_at_step.append(len(engine.batcher.running))
        return step(*args, **kwargs)

    def spy_abort(rid: str) -> None:
        if not timed:  # the first abort follows the timed steps
            timed.extend(running_at_step[-3:])
        abort(rid)

    engine.step = spy_step  # type: ignore[method-assign]
    engine.abort = spy_abort  # type: ignore[method-assign]
    grid = ProfileGrid(decode_batch_sizes=(4,), decode_context_lens=(200,), repeats=3)
    points = measure_decode(engine, grid)
    assert [(p.batch_size, p.context_tokens) for p in points] == [(4, 800)]
    assert timed == [4, 4, 4]
    assert not engine.has_unfinished()


def test_a_fresh_engine_decodes_untimed_before_the_first_point() -> None:
    torch.manual_seed(0)
    engine = Engine("tiny", EngineConfig(max_num_batched_tokens=128, kv_cache_bytes=8 << 20))
    events: list[str] = []
    step, add = engine.step, engine.add_request

    def spy_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("step")
        return step(*args, **kwargs)

    def spy_add(rid: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(rid)
        return add(rid, *args, **kwargs)

    engine.step = spy_step  # type: ignore[method-assign]
    engine.add_request = spy_add  # type: ignore[method-assign]
    measure_decode(engine, ProfileGrid(decode_batch_sizes=(1,), decode_context_lens=(64,),
                                       repeats=2))
    first_point = next(i for i, e in enumerate(events) if e.startswith("profile-decode-0"))
    assert events[0] == "profile-decode-warm-up"
    assert events[1:first_point] == ["step"] * 4  # its prefill and three decode steps
