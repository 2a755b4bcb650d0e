"""`CppRole`: a worker that is one stage of a chunked-pipeline-parallel (CPP) prefill group.

The worker loads only its slice of the layers (`StageEngine`, stage s of X) and owns only those
layers' KV; the frontend places prompts of `cpp_min_tokens` or more on the whole group. Lifecycle
of one request on stage s, on the engine-loop thread (F = the frontend, which relays the
stage-to-stage messages; hidden states themselves go straight into the next stage's inbox, a
transfer segment: shared memory on one host, TCP across hosts):

  CppOrder     (F, to every stage at once) with `fetch_keys` (the Conductor planned a prefix
               from the store): the fetcher thread reads this stage's layers of those blocks
               (its slice objects, else its part of whole blocks: block_fetch.read_layers)
               while the stage keeps computing; then (or at once) allocate the request's
               blocks in this stage's pool (no room now: it waits, in order, until the requests
               before it finish) and import the fetched prefix (the longest run read intact).
               Stage 0 queues the chunks of the prompt after its prefix (it embeds the tokens
               itself).
  CppHidden    (stage s-1) chunk i's hidden states are in slot k of this stage's inbox: queue it.
  first chunk  its start is the prefix the group reuses (stage 0's): this stage writes its
               layers of the prefix blocks into the decode worker's reserved blocks (a stage
               that fetched less than that fails the request, saying so).
  step         run the oldest queued chunk through this stage's layers; from the layer hook
               each layer's KV of the chunk is written straight into the decode worker's
               reserved blocks (as the prefill role does). Then `CppSlotFree(k)` back to s-1,
               and the chunk's hidden states into a free slot of s+1's inbox + `CppHidden` to
               s+1. With no free slot the output waits and this stage runs nothing more until
               s+1 frees one (back-pressure; `SLOTS` = 2 is double buffering).
  last chunk   this stage's layers of the prompt's full blocks after the reused prefix to the
               store (`StageStoreWriter`, its own thread; the frontend lists a block once all
               stages stored their slices), wait for this stage's KV writes, free its blocks,
               `PrefillDone`: the last stage
               with the first token it sampled (and the seeded sampler's state), the others
               with first_token_id -1, each with the prefix reused (num_cached_tokens) and
               its fetch figures. The frontend sends `DecodeOrder` once every stage is done.
  CppSlotFree(-1)  (F) the next stage (re)joined with an empty inbox: every slot is free.
  Abort        drop the request's fetch result, queued chunks (their inbox slots go back), wait for its KV
               writes, free its blocks, ack with `RequestFailed("aborted")`.

Sampling on the group: the last stage samples the first token as the engine does (min_tokens,
penalties, seeds, log probabilities) and computes prompt log probabilities chunk by chunk when
asked (such a request reuses no prefix: a reused prefix has no logits, as on one engine).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvcake.engine.sampling import SamplingParams
from kvcake.engine.stage import StageEngine, split_layers
from kvcake.server.worker.block_fetch import StoredLayout, read_layers, readable_by_all
from kvcake.server.worker.cpp_stage import CppBegin, CppChunk, CppMember, KvTarget
from kvcake.server.worker.messages import (
    NEXT_STAGE_NEW,
    Abort,
    CppHidden,
    CppOrder,
    CppSlotFree,
    Message,
    PrefillDone,
    RequestFailed,
    sampling_from_wire,
)
from kvcake.server.worker.role import RoleHost, sampling_params, wire_logprobs
from kvcake.server.worker.stage_store import StageStoreWriter
from kvcake.transfer import SegmentDesc, TransferError

log = logging.getLogger(__name__)

SLOTS = 2  # chunks each inbox holds: double buffering


@dataclass(frozen=True)
class _Parked:
    """A chunk's hidden states waiting for a free slot of the next stage's inbox."""

    chunk: CppChunk
    hidden: torch.Tensor
    inbox: SegmentDesc


@dataclass(frozen=True)
class _Fetched:
    """What the fetcher thread read of an order's prefix (size None: not in the store)."""

    request_id: str
    sizes: list[int | None]
    buffers: list[bytearray]
    seconds: float
    nbytes: int = 0  # read from the store (the stage's slices, or whole blocks)


@dataclass
class _Prefix:
    """The prefix a request reuses on this stage: the tokens its imported blocks cover, the
    tokens the group reuses (the first chunk's start; None until it arrives), the fetch."""

    usable_tokens: int = 0
    reused_tokens: int | None = None
    fetch_bytes: int = 0
    fetch_s: float = 0.0


class CppRole:
    def __init__(self, worker: RoleHost, stage: StageEngine) -> None:
        assert worker.transfer is not None
        cfg = worker.config
        self.worker = worker
        self.stage = stage
        self.member = CppMember(stage, worker.transfer, member=cfg.cpp_member or 0,
                                chunk_tokens=cfg.cpp_chunk_tokens, slots=SLOTS,
                                tag=worker.worker_id)
        self.chunk_tokens = cfg.cpp_chunk_tokens
        self.split = tuple(split_layers(stage.model_config.num_layers, cfg.cpp_nodes))
        self.store_writer = StageStoreWriter(worker, stage)
        self._ready: deque[CppChunk] = deque()  # chunks whose input is here, in order
        self._parked: _Parked | None = None
        self._free_next = list(range(SLOTS))  # free slots of the next stage's inbox
        self._orders: dict[str, CppOrder] = {}  # begun: blocks allocated in this stage
        # accepted, waiting for room in this stage's pool (in arrival order: the pipeline's)
        self._waiting: dict[str, tuple[CppOrder, CppBegin, SamplingParams]] = {}
        self._started_s: dict[str, float] = {}
        self._fetches: queue.Queue[CppOrder | None] = queue.Queue()
        self._fetcher: threading.Thread | None = None
        self._fetching: set[str] = set()  # waiting for the fetcher's answer
        self._fetched: dict[str, _Fetched] = {}  # answered, not begun yet
        self._prefix: dict[str, _Prefix] = {}  # begun
        self.num_chunks = 0  # chunks this stage computed (tests, inspection)
        self.num_tokens = 0  # prompt tokens this stage computed (tests, inspection)

    @property
    def inbox(self) -> SegmentDesc | None:
        return self.member.inbox

    # -- the role contract (role.py) -----------------------------------------------------------
    def start(self) -> None:
        self.store_writer.start()
        if self.worker.store is not None:
            self._fetcher = threading.Thread(target=self._fetch_loop, daemon=True,
                                             name=f"{self.worker.worker_id}-fetcher")
            self._fetcher.start()

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetches.put(None)
            self._fetcher.join(timeout=10)
        self.store_writer.close()

    def has_pending(self) -> bool:
        """A step can run now: a parked output with a free slot, or a queued chunk."""
        if self._parked is not None:
            return bool(self._free_next)
        return bool(self._ready) and self._ready[0].request_id not in self._waiting

    def num_pending(self) -> int:
        return len(self._ready) + (self._parked is not None) + len(self._waiting)

    def after_step(self) -> None:
        pass

    def handle(self, message: Message) -> None:
        if isinstance(message, CppOrder):
            self._begin(message)
        elif isinstance(message, CppHidden):
            rid = message.request_id
            if not self.member.has(rid) and rid not in self._waiting:  # aborted or refused
                self.worker.send(CppSlotFree(message.request_id, message.slot))
                return
            self._ready.append(CppChunk(message.request_id, message.start, message.num_tokens,
                                        message.slot))
        elif isinstance(message, CppSlotFree):
            if message.slot == NEXT_STAGE_NEW:  # the next stage restarted: an empty inbox
                self._free_next = list(range(SLOTS))
                self._parked = None  # its request failed with the old stage
                return
            if not 0 <= message.slot < SLOTS or message.slot in self._free_next:
                log.warning("%s: ignoring a bad CppSlotFree %d", self.worker.worker_id,
                            message.slot)
                return
            self._free_next.append(message.slot)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        elif isinstance(message, _Fetched):
            if message.request_id in self._fetching:
                self._fetching.discard(message.request_id)
                self._fetched[message.request_id] = message
                self._admit_waiting()

    def step(self) -> None:
        if self._parked is not None:
            if self._free_next:
                parked, self._parked = self._parked, None
                self._send_hidden(parked.chunk, parked.hidden, parked.inbox)
            return
        if not self._ready or self._ready[0].request_id in self._waiting:
            return  # (a request still waiting for room here is first in line)
        chunk = self._ready.popleft()
        rid = chunk.request_id
        final = self.member.is_final(chunk)
        self._started_s.setdefault(rid, time.perf_counter())
        try:
            self._reuse_prefix(chunk)
            out = self.member.compute(chunk)
        except Exception as exc:  # one bad request must not stop the stage
            log.exception("%s: chunk %d of %s failed", self.worker.worker_id, chunk.start, rid)
            if chunk.slot >= 0:
                self.worker.send(CppSlotFree(rid, chunk.slot))
            self._abort(rid, f"cpp stage {self.member.member} failed: {exc}")
            return
        self.num_chunks += 1
        self.num_tokens += chunk.num_tokens
        if chunk.slot >= 0:  # its hidden states are read: the stage before may write it again
            self.worker.send(CppSlotFree(rid, chunk.slot))
        if isinstance(out, torch.Tensor):
            inbox = SegmentDesc.from_dict(self._orders[rid].next_inbox)
            if self._free_next:
                self._send_hidden(chunk, out, inbox)
            else:
                self._parked = _Parked(chunk, out.clone(), inbox)
        if final and rid in self._orders:
            self._finish(rid, out if isinstance(out, int) else None)

    # -- a request -----------------------------------------------------------------------------
    def _begin(self, order: CppOrder) -> None:
        rid = order.request_id
        try:
            params = sampling_params(sampling_from_wire(order.sampling))
            target = KvTarget(order.kv_pool, order.num_pool_blocks, tuple(order.target_blocks)) \
                if order.target_blocks else None
            if not self.stage.is_last and not order.next_inbox:
                raise ValueError("next_inbox: a stage before the last needs the next one's inbox")
            needed = -(-len(order.prompt_token_ids) // self.stage.block_size)
            room = self.stage.block_manager.num_blocks
            if needed > room:
                raise ValueError(f"the prompt needs {needed} KV blocks, this stage's pool has "
                                 f"{room}: give the workers more --kv-cache-bytes")
        except ValueError as exc:
            self.worker.send(RequestFailed(rid, f"cpp stage {self.member.member} refused the "
                                                f"prefill: {exc}"))
            return
        begin = CppBegin(rid, tuple(order.prompt_token_ids), params.max_tokens, target)
        self._waiting[rid] = (order, begin, params)
        if order.fetch_keys and self.worker.store is not None and params.prompt_logprobs is None:
            # The store read runs on the fetcher thread, so the stage keeps computing.
            self._fetching.add(rid)
            self._fetches.put(order)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Begin the waiting requests, in order, while this stage's pool has room for them
        (the requests before them free it as they finish)."""
        while self._waiting:
            rid, (order, begin, params) = next(iter(self._waiting.items()))
            if rid in self._fetching or not self.member.begin(begin, params):
                return
            del self._waiting[rid]
            self._orders[rid] = order
            fetched = self._fetched.pop(rid, None)
            # prompt log probabilities need every prompt row's logits: no prefix reuse
            prefix = self._import_prefix(rid, order, fetched) \
                if params.prompt_logprobs is None else _Prefix()
            self._prefix[rid] = prefix
            if self.stage.is_first:
                n = len(order.prompt_token_ids)
                self._ready.extend(CppChunk(rid, s, min(self.chunk_tokens, n - s), -1)
                                   for s in range(prefix.usable_tokens, n, self.chunk_tokens))

    # -- prefix reuse --------------------------------------------------------------------------
    def _fetch_loop(self) -> None:
        store = self.worker.store
        assert store is not None
        stage = self.stage
        layout = StoredLayout(stage.namespace, stage.pool.layer_nbytes,
                              stage.model_config.num_layers, self.split)
        while (order := self._fetches.get()) is not None:  # this stage's layers only
            read = read_layers(store, layout, order.fetch_keys, stage.layers,
                               self.worker.worker_id)
            sizes = read.sizes
            if stage.is_first:  # the prefix stage 0 reuses is the group's: all must have it
                sizes = readable_by_all(store, layout, order.fetch_keys, sizes, stage.layers,
                                        self.worker.worker_id)
            self.worker.post(_Fetched(order.request_id, sizes, read.buffers, read.seconds,
                                      read.nbytes))

    def _import_prefix(self, rid: str, order: CppOrder, fetched: _Fetched | None) -> _Prefix:
        """This stage's layers of the longest run of prefix blocks read intact, into its pool
        (the request's blocks are allocated). The last prompt token is always computed: its
        hidden state gives the first token."""
        if fetched is None:
            return _Prefix()
        nbytes = self.stage.pool.layer_nbytes * len(self.stage.layers)
        usable = 0
        for size in fetched.sizes:
            if size != nbytes:
                break  # later blocks are useless without this one
            usable += 1
        usable = min(usable, len(order.prompt_token_ids) // self.stage.block_size)
        self.member.import_prefix(rid, fetched.buffers[:usable])
        return _Prefix(min(usable * self.stage.block_size, len(order.prompt_token_ids) - 1),
                       None, fetched.nbytes, fetched.seconds)

    def _reuse_prefix(self, chunk: CppChunk) -> None:
        """At a request's first chunk: the group reuses the prefix before it (stage 0's). Write
        this stage's layers of those blocks into the decode worker's; ValueError when this
        stage imported less of it."""
        prefix = self._prefix[chunk.request_id]
        if prefix.reused_tokens is not None:
            return
        if chunk.start > prefix.usable_tokens:
            raise ValueError(f"the group reuses a prefix of {chunk.start} tokens, this stage "
                             f"read only {prefix.usable_tokens} of it from the store")
        prefix.reused_tokens = chunk.start
        self.member.stream_prefix(chunk.request_id, chunk.start // self.stage.block_size)

    def _send_hidden(self, chunk: CppChunk, hidden: torch.Tensor, inbox: SegmentDesc) -> None:
        slot = self._free_next.pop(0)
        try:
            self.member.write_hidden(hidden, slot, inbox)
        except TransferError as exc:
            self._free_next.append(slot)
            self._abort(chunk.request_id, f"hidden states to the next stage failed: {exc}")
            return
        self.worker.send(CppHidden(chunk.request_id, chunk.start, chunk.num_tokens, slot))

    def _finish(self, rid: str, token: int | None) -> None:
        order = self._orders.pop(rid)
        prefix = self._prefix.pop(rid, _Prefix())
        sampler_state = self.stage.sampler_state(rid) if token is not None else None
        first = self.stage.first_token_logprobs(rid) if token is not None else None
        prompt_lp = self.stage.prompt_logprobs(rid) if token is not None else None
        ended = time.perf_counter()
        bs = self.stage.block_size
        reused = prefix.reused_tokens or 0
        try:
            done = self.member.finish(rid, release=False)
        except TransferError as exc:
            self.stage.release(rid)
            self.worker.send(RequestFailed(rid, f"KV transfer to the decode worker failed: "
                                                f"{exc}"))
            self._admit_waiting()
            return
        exposed_s = time.perf_counter() - ended
        span_s = time.perf_counter() - self._started_s.pop(rid, ended)
        self.worker.send(PrefillDone(
            rid, -1 if token is None else token,
            None if token is None else self._finish_reason(order, token), reused,
            -(-reused // bs) * bs,  # the blocks read for it (the last one maybe recomputed)
            done.compute_s, span_s if done.kv_bytes else 0.0,
            exposed_s if done.kv_bytes else 0.0, done.kv_bytes, sampler_state,
            wire_logprobs([first]) if first else None, prefix.fetch_bytes, prefix.fetch_s,
            None if prompt_lp is None else [None, *(wire_logprobs(prompt_lp) or [])]))
        # Every prompt to the store, as a prefill worker's (after the report: off the TTFT):
        # this stage's layers of the blocks after the reused prefix (a block partly recomputed
        # at its end was read from there), then its blocks are free.
        try:
            self.store_writer.write_prompt(rid, order.prompt_token_ids, -(-reused // bs))
        except Exception:  # a store copy that fails must not stop the stage: nothing stored
            log.exception("%s: storing %s's blocks failed", self.worker.worker_id, rid)
        finally:
            self.stage.release(rid)
        self._admit_waiting()

    def _finish_reason(self, order: CppOrder, token: int) -> str | None:
        """As the engine decides at a first token: a stop id or EOS ends it, else max_tokens 1."""
        params = sampling_params(sampling_from_wire(order.sampling))
        if token in params.stop_token_ids or (
                not params.ignore_eos and token in self.stage.model_config.eos_token_ids):
            return "stop"
        return "length" if params.max_tokens <= 1 else None

    def _abort(self, rid: str, answer: str = "aborted") -> None:
        kept: deque[CppChunk] = deque()
        for chunk in self._ready:
            if chunk.request_id != rid:
                kept.append(chunk)
            elif chunk.slot >= 0:
                self.worker.send(CppSlotFree(rid, chunk.slot))
        self._ready = kept
        if self._parked is not None and self._parked.chunk.request_id == rid:
            self._parked = None
        self._started_s.pop(rid, None)
        self._fetching.discard(rid)
        self._fetched.pop(rid, None)
        self._prefix.pop(rid, None)
        if self._waiting.pop(rid, None) is not None:
            self.worker.send(RequestFailed(rid, answer))
            self._admit_waiting()  # it may have held the line (its fetch)
        elif self._orders.pop(rid, None) is not None:
            self.member.abort(rid)  # returns once nothing of it writes the decode pool
            self.worker.send(RequestFailed(rid, answer))
            self._admit_waiting()

