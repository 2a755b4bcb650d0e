"""Batcher: exact plans for chunked prefill, continuous batching, admission and preemption."""

from __future__ import annotations

from kvcake.engine.batcher import Batcher, ScheduledChunk
from kvcake.engine.block_manager import BlockManager
from kvcake.engine.sequence import Sequence, SequenceStatus
from kvcake.types import RequestId


def seq(rid: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(RequestId(rid), list(range(n)), n, max_tokens, block_size=4, namespace="t")


def advance(batcher: Batcher, chunks: list[ScheduledChunk], seqs: dict[str, Sequence]) -> None:
    """What the engine does after a step: progress, and a token for each sampling chunk."""
    for c in chunks:
        s = seqs[c.request_id]
        s.num_computed_tokens += c.num_tokens
        if c.samples:
            s.token_ids.append(0)
        s.update_block_keys()
        batcher.block_manager.cache_full_blocks(s.request_id, s.block_keys[: s.num_computed_tokens // 4])


def test_chunked_prefill_joins_running_decode() -> None:
    b = Batcher(BlockManager(num_blocks=16, block_size=4), max_num_batched_tokens=8, max_num_seqs=4)
    seqs = {"a": seq("a", 5), "b": seq("b", 13)}
    b.add(seqs["a"])
    b.add(seqs["b"])
    plan = b.schedule()
    assert plan.chunks == [ScheduledChunk("a", 0, 5, True), ScheduledChunk("b", 0, 3, False)]
    advance(b, plan.chunks, seqs)
    plan = b.schedule()  # a decodes one token; b continues its prompt with the remaining 7
    assert plan.chunks == [ScheduledChunk("a", 5, 1, True), ScheduledChunk("b", 3, 7, False)]
    advance(b, plan.chunks, seqs)
    plan = b.schedule()
    assert plan.chunks == [ScheduledChunk("a", 6, 1, True), ScheduledChunk("b", 10, 3, True)]
    assert b.block_manager.block_ids("a") == [0, 1] and b.block_manager.block_ids("b") == [2, 3, 4, 5]


def test_admission_waits_for_seats_and_blocks() -> None:
    b = Batcher(BlockManager(num_blocks=4, block_size=4), max_num_batched_tokens=64, max_num_seqs=1)
    b.add(seq("a", 4))
    b.add(seq("b", 4))
    plan = b.schedule()
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert [s.request_id for s in b.waiting] == ["b"]  # max_num_seqs=1
    b.finish(b.running[0])
    assert [c.request_id for c in b.schedule().chunks] == ["b"]


def test_preemption_frees_newest_and_requeues_it_first() -> None:
    b = Batcher(BlockManager(num_blocks=3, block_size=4), max_num_batched_tokens=64, max_num_seqs=4)
    seqs = {"a": seq("a", 4), "b": seq("b", 4)}
    b.add(seqs["a"])
    b.add(seqs["b"])
    plan = b.schedule()
    advance(b, plan.chunks, seqs)
    # Both now need a second block; one is free: a takes it, b is preempted.
    plan = b.schedule()
    assert plan.chunks == [ScheduledChunk("a", 4, 1, True)]
    assert plan.preempted_ids == ["b"]
    assert seqs["b"].status is SequenceStatus.WAITING and seqs["b"].num_computed_tokens == 0
    assert b.waiting[0] is seqs["b"] and b.block_manager.block_ids("a") == [0, 2]


def test_admitted_ids_name_first_admissions_only() -> None:
    """The engine stamps a request's queue-time end on the step that lists it here: a sequence
    coming back after preemption keeps its first stamp, so it is not listed again."""
    b = Batcher(BlockManager(num_blocks=3, block_size=4), max_num_batched_tokens=64, max_num_seqs=4)
    seqs = {"a": seq("a", 4), "b": seq("b", 4)}
    b.add(seqs["a"])
    b.add(seqs["b"])
    plan = b.schedule()
    assert plan.admitted_ids == ["a", "b"]
    advance(b, plan.chunks, seqs)
    plan = b.schedule()  # a decodes, b is preempted
    assert plan.admitted_ids == [] and plan.preempted_ids == ["b"]
    b.finish(seqs["a"])
    plan = b.schedule()  # b readmitted (its first block from the prefix cache): not listed
    assert plan.chunks == [ScheduledChunk("b", 4, 1, True)] and plan.admitted_ids == []


def test_a_decode_only_step_admits_nobody() -> None:
    b = Batcher(BlockManager(num_blocks=8, block_size=4), max_num_batched_tokens=64, max_num_seqs=4)
    seqs = {"a": seq("a", 3)}
    b.add(seqs["a"])
    advance(b, b.schedule().chunks, seqs)
    plan = b.schedule()
    assert plan.chunks == [ScheduledChunk("a", 3, 1, True)] and plan.admitted_ids == []
