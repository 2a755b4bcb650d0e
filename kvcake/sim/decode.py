"""A simulated instance that decodes with continuous batching, and optionally prefills too.

Lifecycle of a sequence on a disaggregated decode instance:

    add(seq)  ->  waiting  --(next step boundary, KV capacity free)-->  running
              ->  one token per step  ->  finished (remaining == 0), its KV freed

A sequence joins holding its reservation (`Seq.reserve_len`: on a disaggregated node the prompt
plus the output length the node was told); past it, it grows one KV token per step while the
node has free KV. When the growing sequences need more than is free, the newest sequence of the
batch is preempted, as a live engine's batcher does: swapped out to the node's DRAM (its KV
leaves the batch, `swapped_tokens` counts it), back at the head of the waiting queue, resuming
when room frees; the stall shows in its next token gap. The swap's copy time is not priced.

Runs of identical steps are planned in closed form (`steps.StepRun`): one DECODE_STEP_DONE
event per run, not per token. A run ends when its first member finishes; a sequence that arrives
meanwhile cuts the run at the next step boundary (continuous batching admits new sequences only
between steps).

A colocated (vLLM-like) instance also holds a prefill queue. Without chunked prefill a waiting
prefill runs as one step of its own and every decoding sequence stalls for it (its next token
gap holds the whole prefill). With chunked prefill each step carries the decode batch plus a
chunk of the head prefill, `chunk_budget_tokens - batch_size` tokens, and lasts the decode step
plus the chunk's prefill time: decodes never stall but every step is slower. With busy costs
(`StepCosts.decode_step_busy_s` and `chunk_busy_s`, a live profile's colocated terms) a run is
priced by whether the host's other worker steps (`host_prefill_busy`) and cut at its next step
boundary when that changes (`follow_host`).

Passive state: the cluster calls `add`/`add_prefill`/`on_step_done` and schedules the events
they return.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcake.sim.events import Event, EventKind
from kvcake.sim.metrics import GapLog
from kvcake.sim.steps import StepRun, plan_run


@dataclass(slots=True)
class Seq:
    """One request on a decode-capable instance.

    context_len: KV tokens it holds now. remaining: output tokens still to generate.
    reserve_len: KV tokens reserved when it joins: on a disaggregated decode node the prompt plus
    the output length the node was told (what a live node knows, never the true length); a
    colocated sequence reserves its whole life (prompt + output). A sequence that runs past its
    reservation holds `held` = its context: it grows while the node has free KV, else the
    newest sequence of the batch is preempted (`preemptions`). prefill_done_len / prefix_len:
    colocated prefill progress (tokens).
    """

    req: int
    context_len: int
    remaining: int
    reserve_len: int
    last_token_s: float = 0.0
    gaps: GapLog = field(default_factory=GapLog)
    prefill_done_len: int = 0
    prefix_len: int = 0  # colocated: prompt tokens reused from the prefix cache
    prefill_started: bool = False  # colocated: its first chunk was scheduled
    preemptions: int = 0  # times it was preempted (swapped out) for want of KV

    @property
    def held(self) -> int:
        """KV tokens it holds on its node: its reservation, or its context once past it."""
        return max(self.reserve_len, self.context_len)


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds of one decode step and of one prefill chunk (from the cost model)."""

    decode_step_s: Callable[[int, int], float]  # (batch_size, context_tokens), overhead included
    prefill_s: Callable[[int, int], float]  # (input_len, prefix_len): one whole-prompt forward
    # (input_len, prefix_len, num_tokens, forward_tokens): a chunk's compute inside a forward
    chunk_s: Callable[[int, int, int, int], float] | None = None
    step_overhead_s: float = 0.0  # a forward's fixed cost (paid by a chunk-only step)
    # a decode step while the host's prefill worker computes (None: no such coupling); on a
    # colocated instance: while the host's other worker steps
    decode_step_busy_s: Callable[[int, int], float] | None = None
    # colocated: a chunk's compute while the host's other worker steps (as `chunk_s`)
    chunk_busy_s: Callable[[int, int, int, int], float] | None = None


class DecodeInstance:
    """Continuous batching on one instance; with `colocated`, it also prefills."""

    def __init__(
        self,
        index: int,
        costs: StepCosts,
        max_kv_tokens: int,
        max_batch_size: int,
        colocated: bool = False,
        chunk_budget_tokens: int | None = None,
    ) -> None:
        if max_kv_tokens < 1 or max_batch_size < 1:
            raise ValueError(f"max_kv_tokens ({max_kv_tokens}) and max_batch_size "
                             f"({max_batch_size}) must be >= 1")
        if chunk_budget_tokens is not None and chunk_budget_tokens <= max_batch_size:
            raise ValueError(f"chunk_budget_tokens ({chunk_budget_tokens}) must exceed "
                             f"max_batch_size ({max_batch_size}) to leave room for a chunk")
        self.index = index
        self.costs = costs
        self.max_kv_tokens = max_kv_tokens
        self.max_batch_size = max_batch_size
        self.colocated = colocated
        self.chunk_budget_tokens = chunk_budget_tokens
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()  # KV here (or prefilled), waiting to join
        self.prefills: deque[Seq] = deque()  # colocated: waiting to be prefilled
        self.reserved_tokens = 0
        self.swapped_tokens = 0  # KV of preempted sequences waiting to come back
        self.preemptions = 0
        self.run: StepRun | None = None
        self._run_prefill: Seq | None = None  # the prefill this run works on, if any
        self._run_chunk = 0  # prefill tokens per step of this run
        self._reserved_head: Seq | None = None  # the head prefill whose KV is reserved
        self.joined: list[Seq] = []  # admitted to the batch since the cluster last took them
        self.started: list[Seq] = []  # colocated: first chunk scheduled since the last take
        self.token = 0
        self.busy_s = 0.0
        self.prefill_compute_s = 0.0
        # whether a prefill computes on this host now (the cluster's; with StepCosts' busy cost)
        self.host_prefill_busy: Callable[[], bool] | None = None
        self._run_busy = False  # what host_prefill_busy said when the current run was planned

    # -- inputs ---------------------------------------------------------------------------

    def take_joined(self) -> list[Seq]:
        """The sequences that joined the batch (had KV space) since the last call."""
        joined, self.joined = self.joined, []
        return joined

    def take_started(self) -> list[Seq]:
        """Colocated: the prefills whose first chunk (or whole prompt) was scheduled since the
        last call, at the start of that step: when a live worker reports `PrefillStarted`."""
        started, self.started = self.started, []
        return started

    def add(self, now_s: float, seq: Seq) -> Event | None:
        """A sequence whose KV is here; it joins at the next step boundary with room for its
        KV (`take_joined` says when)."""
        self.waiting.append(seq)
        return self._nudge(now_s)

    def add_prefill(self, now_s: float, seq: Seq) -> Event | None:
        """Colocated: a request to prefill here, then decode here."""
        if not self.colocated:
            raise ValueError(f"instance {self.index} is not colocated; it does not prefill")
        self.prefills.append(seq)
        return self._nudge(now_s)

    def follow_host(self, now_s: float) -> Event | None:
        """Called after every event: if the host's prefill worker started or stopped computing
        since the decode run was planned (`host_prefill_busy`, with a busy step cost
        `StepCosts.decode_step_busy_s`), the run is cut at its next step boundary and the steps
        after it are planned at the new cost (the step in flight keeps its own)."""
        if self.host_prefill_busy is None or self.costs.decode_step_busy_s is None or \
                self.run is None or self.host_prefill_busy() == self._run_busy:
            return None
        if self._run_prefill is not None and (self.chunk_budget_tokens is None
                                              or self.costs.chunk_busy_s is None):
            return None  # a whole prefill, or chunks priced alike busy or not
        return self._cut(now_s)

    def on_step_done(self, now_s: float, token: int) -> tuple[list[Seq], list[Seq], Event | None]:
        """End of a run: returns (sequences that got their first token, finished, next event)."""
        if token != self.token or self.run is None:
            return [], [], None  # a run that was cut short
        run, self.run = self.run, None
        n = run.num_steps
        self.busy_s += run.elapsed_s(n)
        head = self._run_prefill
        whole_prefill = head is not None and self.chunk_budget_tokens is None
        if not whole_prefill:  # a whole-prompt prefill step gives the batch no token
            held_before = sum(s.held for s in self.running)
            for seq in self.running:
                _log_run(seq, run)
            self.reserved_tokens += sum(s.held for s in self.running) - held_before
        first_tokens: list[Seq] = []
        if head is not None:
            self.prefill_compute_s += self._prefill_share_s(head.prefill_done_len, n)
            head.prefill_done_len += n * self._run_chunk
            if head.prefill_done_len >= head.context_len:
                self.prefills.popleft()
                self._reserved_head = None
                head.last_token_s = run.end_s
                first_tokens.append(head)
        finished = [s for s in self.running if s.remaining == 0]
        if finished:
            self.running = [s for s in self.running if s.remaining > 0]
        for seq in first_tokens:
            if seq.remaining > 0:
                self.running.append(seq)
            else:
                finished.append(seq)
        for seq in finished:
            self.reserved_tokens -= seq.held
        return first_tokens, finished, self._start(now_s)

    # -- planning -------------------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return self.run is None

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def kv_tokens(self) -> int:
        """KV tokens the node owes: its batch's, plus its preempted sequences' to come back."""
        return self.reserved_tokens + self.swapped_tokens

    @property
    def context_tokens(self) -> int:
        return sum(s.context_len for s in self.running)

    def _nudge(self, now_s: float) -> Event | None:
        if self.run is None:
            return self._start(now_s)
        if self._run_prefill is not None and self.chunk_budget_tokens is None:
            return None  # a whole prefill is running; it cannot be cut
        return self._cut(now_s)

    def _cut(self, now_s: float) -> Event | None:
        """End the current run at its next step boundary (None: it ends there anyway)."""
        assert self.run is not None
        k = self.run.steps_done_by(now_s)
        if k + 1 >= self.run.num_steps:
            return None  # the run ends at the next boundary anyway
        self.run = self.run.truncated(k + 1)
        self.token += 1
        return Event(self.run.end_s, EventKind.DECODE_STEP_DONE, self.index, self.token)

    def _admit(self) -> None:
        growing = sum(1 for s in self.running if s.context_len >= s.reserve_len)
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            grows = seq.context_len >= seq.reserve_len
            # room for its KV and for the next token of every sequence past its reservation
            if self.reserved_tokens + seq.held + growing + grows > self.max_kv_tokens \
                    and self.running:
                break  # no room: it waits for a sequence to finish (an empty batch takes it)
            self.waiting.popleft()
            self.reserved_tokens += seq.held
            self.running.append(seq)
            growing += grows
            if seq.preemptions:  # back from a preemption: it joined before
                self.swapped_tokens -= seq.held
            else:
                self.joined.append(seq)

    def _make_room(self) -> None:
        """Preempt the newest sequences of the batch until the free KV holds one more token of
        every sequence past its reservation (a batch of one always runs)."""
        while len(self.running) > 1:
            growing = sum(1 for s in self.running if s.context_len >= s.reserve_len)
            if self.reserved_tokens + growing <= self.max_kv_tokens:
                return
            victim = self.running.pop()
            self.reserved_tokens -= victim.held
            self.swapped_tokens += victim.held
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)

    def _growth_steps(self, max_steps: int) -> int:
        """The most steps, up to `max_steps`, the batch can run before the KV its sequences grow
        past their reservations fills the free KV (a batch of one always runs)."""
        free = self.max_kv_tokens - self.reserved_tokens

        def growth(n: int) -> int:
            return sum(max(0, s.context_len + n - max(s.reserve_len, s.context_len))
                       for s in self.running)

        if len(self.running) < 2 or growth(max_steps) <= free:
            return max_steps
        lo, hi = 1, max_steps  # growth(1) <= free after _make_room; growth(hi) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if growth(mid) <= free else (lo, mid)
        return lo

    def _start(self, now_s: float) -> Event | None:
        self._make_room()
        self._admit()
        self._run_prefill, self._run_chunk = None, 0
        if self.prefills and self._reserve_head():
            self.run = self._plan_prefill(now_s, self.prefills[0])
        elif self.running:
            self.run = self._plan_decode(now_s)
        else:
            self.run = None
            return None
        self.token += 1
        return Event(self.run.end_s, EventKind.DECODE_STEP_DONE, self.index, self.token)

    def _reserve_head(self) -> bool:
        head = self.prefills[0]
        if head.prefill_done_len > 0 or head is self._reserved_head:
            return True
        fits = self.reserved_tokens + head.reserve_len <= self.max_kv_tokens
        if fits or not self.running:
            self.reserved_tokens += head.reserve_len
            self._reserved_head = head
            return True
        return False

    def _plan_decode(self, now_s: float) -> StepRun:
        batch, context = len(self.running), self.context_tokens
        max_steps = self._growth_steps(min(s.remaining for s in self.running))
        step = self.costs.decode_step_s
        self._run_busy = self.host_prefill_busy is not None and self.host_prefill_busy()
        if self._run_busy and self.costs.decode_step_busy_s is not None:
            step = self.costs.decode_step_busy_s
        return plan_run(now_s, max_steps, lambda i: step(batch, context + i * batch))

    def _plan_prefill(self, now_s: float, head: Seq) -> StepRun:
        self._run_prefill = head
        self._run_busy = self.host_prefill_busy is not None and self.host_prefill_busy()
        start, total = head.prefill_done_len, head.context_len
        if start == head.prefix_len and not head.prefill_started:
            head.prefill_started = True
            self.started.append(head)
        if self.chunk_budget_tokens is None:  # the whole prompt in one step; decodes stall
            self._run_chunk = total - start
            return StepRun(now_s, 1, self.costs.prefill_s(total, start), 0.0)
        batch, context = len(self.running), self.context_tokens
        chunk = self.chunk_budget_tokens - batch
        full_chunks = (total - start) // chunk
        if full_chunks == 0:  # the last, partial chunk: a run of one step
            self._run_chunk = total - start
            return StepRun(now_s, 1, self._chunk_step_s(batch, context, head, total - start), 0.0)
        max_steps = min([full_chunks] + [s.remaining for s in self.running])
        self._run_chunk = chunk

        def step_s(i: int) -> float:
            return self._chunk_step_s(batch, context + i * batch, head, chunk)

        return plan_run(now_s, max_steps, step_s)

    def _prefill_share_s(self, begin: int, num_steps: int) -> float:
        """Prefill seconds of `num_steps` steps of the head from token `begin` (decode excluded)."""
        head = self.prefills[0]
        if self.chunk_budget_tokens is None:  # one whole-prompt forward
            return self.costs.prefill_s(head.context_len, begin)
        return self._chunk_prefill_s(head, min(num_steps * self._run_chunk,
                                               head.context_len - begin),
                                     self.chunk_budget_tokens)

    def _chunk_step_s(self, batch: int, context: int, head: Seq, num_tokens: int) -> float:
        busy = self._run_busy and self.costs.chunk_busy_s is not None
        decode = self.costs.decode_step_busy_s if busy else None
        decode = decode or self.costs.decode_step_s
        decode_s = decode(batch, context) if batch else self.costs.step_overhead_s
        return decode_s + self._chunk_prefill_s(head, num_tokens, batch + num_tokens, busy)

    def _chunk_prefill_s(self, head: Seq, num_tokens: int, forward_tokens: int = 0,
                         busy: bool = False) -> float:
        """A chunk's share of its prompt's prefill FLOPs, by token count, at the MFU of the
        forward it rides in (`StepCosts.chunk_s`; without it, its share of the whole prefill).

        Chunking spreads a prefill's FLOPs over steps; it neither saves nor adds FLOPs (the cost
        model's attention term counts every new token against the whole prompt, so pricing a
        chunk as a prefill of its own would make chunking look cheaper); what it costs is the
        lower MFU of small forwards."""
        new = head.context_len - head.prefix_len
        chunk_s = self.costs.chunk_busy_s if busy else self.costs.chunk_s
        if chunk_s is not None:
            return chunk_s(head.context_len, head.prefix_len, num_tokens,
                           forward_tokens or num_tokens)
        return self.costs.prefill_s(head.context_len, head.prefix_len) * num_tokens / new


def _log_run(seq: Seq, run: StepRun) -> None:
    """Give `seq` one token per step of `run` and log the gaps."""
    n = run.num_steps
    wait_s = run.start_s - seq.last_token_s  # > 0 for a sequence that just joined or stalled
    if wait_s > 1e-12:
        seq.gaps.add(1, wait_s + run.first_s)
        seq.gaps.add(n - 1, run.first_s + run.delta_s, run.delta_s)
    else:
        seq.gaps.add(n, run.first_s, run.delta_s)
    seq.remaining -= n
    seq.context_len += n
    seq.last_token_s = run.end_s
