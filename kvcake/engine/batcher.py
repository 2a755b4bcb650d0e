"""Iteration-level continuous batching with chunked prefill. Pure: plain data in, `BatchPlan` out.

Each `schedule()` call plans one model step under a token budget (`max_num_batched_tokens`):

1. Running sequences first, in admission order: each gets all its uncomputed tokens (one for a
   decoding sequence, the rest of its prompt for a prefilling one) or what is left of the
   budget, so a long prompt is prefilled in chunks across steps while others keep decoding.
   When the pool has no block for a running sequence, the most recently admitted one is
   preempted (blocks freed, back to the head of the queue, recomputed later).
2. Then waiting sequences in arrival order, while budget, `max_num_seqs` and blocks allow.
   Admission allocates blocks for every token the sequence has, reusing cached prefix blocks;
   the first admission records `num_cached_tokens` and lists the sequence in
   `BatchPlan.admitted_ids` (a preempted one coming back is not listed again).

A chunk `samples` when it reaches the sequence's last token: only then are logits computed.
The engine applies the step's results (`Sequence.num_computed_tokens`, new tokens) and calls
`finish()` for finished sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcake.engine.block_manager import BlockManager
from kvcake.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int  # first token position computed this step
    num_tokens: int
    samples: bool


@dataclass
class BatchPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    admitted_ids: list[str] = field(default_factory=list)  # scheduled for the first time

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Batcher:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose blocks are already allocated (e.g. KV supplied externally)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, keep_blocks: bool = False) -> None:
        """Remove `seq` from the queues; free its blocks unless `keep_blocks`."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if not keep_blocks and self.block_manager.has(seq.request_id):
            self.block_manager.free(seq.request_id)

    def schedule(self) -> BatchPlan:
        plan = BatchPlan()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, seq.num_computed_tokens + n, plan):
                continue
            plan.chunks.append(self._chunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and not plan.preempted_ids:
            seq = self.waiting[0]
            cached = self.block_manager.allocate(seq.request_id, seq.num_tokens, seq.admission_keys)
            if cached is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
                plan.admitted_ids.append(seq.request_id)
            self.add_running(seq)
            n = min(seq.num_tokens - cached, budget)
            plan.chunks.append(self._chunk(seq, n))
            budget -= n
        return plan

    def _reserve(self, seq: Sequence, num_tokens: int, plan: BatchPlan) -> bool:
        """Blocks for `num_tokens` of `seq`, preempting the newest running sequences if needed.
        False when `seq` itself had to be preempted."""
        while not self.block_manager.append_slots(seq.request_id, num_tokens):
            victim = self.running.pop()
            self.block_manager.free(victim.request_id)
            victim.status = SequenceStatus.WAITING
            victim.num_computed_tokens = 0
            self.waiting.appendleft(victim)
            plan.preempted_ids.append(victim.request_id)
            plan.chunks = [c for c in plan.chunks if c.request_id != victim.request_id]
            if victim is seq:
                return False
        return True

    @staticmethod
    def _chunk(seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq.request_id, start, n, samples=start + n == seq.num_tokens)
