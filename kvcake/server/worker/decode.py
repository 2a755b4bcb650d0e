"""The decode side of a worker: step 4 of the four (continuous batching of prefilled requests).

The engine's KV pool is a transfer segment, `kv-pool-<id>`, which the worker's transfer engine
allocates (`pool_allocator`, handed to the `Engine`) and the engine views as its pool tensor. In
shared memory (`WorkerConfig.shared_memory`, the default), so a prefill worker on this host
writes it by memcpy through its own mapping (without per-slice digests: the transfer engine's
`checksum_shm`, off) and one on another host over TCP (each slice with a digest); private memory
otherwise (TCP only). The transfer engine unlinks the block when the worker closes (the resource
tracker does if the process dies); a restarted worker gets a new block, so nothing written for
the old one lands in the new pool.

Lifecycle of one request on the engine-loop thread:
  `ReserveKv` -> `engine.reserve_request` -> `KvReserved` (the pool segment and the reserved
  block ids; prefill workers write each layer of each prompt block straight into them) ->
  `DecodeOrder` -> `commit_reserved` (no copy) -> `DecodeAdmitted` -> every step's new tokens
  -> `Tokens` (finish_reason on the last). A CPP group's prompt (`DecodeOrder.store_prompt`)
  is written to the store from here once committed (`StoreWriter`). `Abort` cancels a reservation (the frontend sends it
  only once nothing writes the blocks any more). A reservation the pool has no room for waits
  (in arrival order) until running requests free blocks; one that can never fit, because
  nothing else runs or is reserved, fails with `RequestFailed`.
"""

from __future__ import annotations

import logging
from collections import deque

from kvcake.engine.kv_pool import KvAllocator
from kvcake.engine.step_trace import StepTrace
from kvcake.server.worker.messages import (
    Abort,
    DecodeAdmitted,
    DecodeOrder,
    KvReserved,
    Message,
    RequestFailed,
    ReserveKv,
    Tokens,
    sampling_from_wire,
)
from kvcake.server.worker.role import RoleHost, sampling_params, wire_logprobs
from kvcake.server.worker.store_writer import StoreWriter
from kvcake.transfer import TransferEngine

log = logging.getLogger(__name__)


def pool_segment_name(worker_id: str) -> str:
    """The transfer segment that is decode worker `worker_id`'s KV pool."""
    return f"kv-pool-{worker_id}"


def pool_allocator(transfer: TransferEngine, worker_id: str, *, shared: bool) -> KvAllocator:
    """The engine's KV pool allocated as segment `pool_segment_name(worker_id)` of `transfer`
    (zeroed; shared memory when `shared`), so prefill workers can write it directly. The
    transfer engine owns the memory: it unlinks a shared block on close; the engine's tensor
    view keeps the mapping itself alive."""
    def allocate(length_bytes: int) -> memoryview:
        name = pool_segment_name(worker_id)
        transfer.allocate_segment(name, length_bytes, shared=shared)
        return transfer.segment(name).view
    return allocate


class DecodeRole:
    def __init__(self, worker: RoleHost) -> None:
        assert worker.engine is not None and worker.transfer is not None
        self.worker = worker
        self.engine = worker.engine
        self.transfer = worker.transfer
        self._pool_name = pool_segment_name(worker.worker_id)
        try:
            pool = self.transfer.segment(self._pool_name)
        except KeyError:
            raise ValueError("decode worker: its engine's KV pool must be allocated by its "
                             "transfer engine (Engine(kv_allocator=pool_allocator(...)))") from None
        if pool.array.ctypes.data != self.engine.pool.kv.data_ptr():
            raise ValueError(f"decode worker: segment {self._pool_name!r} is not the memory of "
                             f"its engine's KV pool")
        self._pending: deque[ReserveKv] = deque()  # waiting for room in the pool
        self._live: set[str] = set()
        self._reserved: set[str] = set()  # reserved, not yet committed
        # Kept out of use: their prefill worker was lost while writing them. A later plain
        # `Abort` (the frontend knows that worker is dead: its process reaped) frees them.
        self._kept: set[str] = set()
        self._writer = StoreWriter(worker, self.engine)
        self._trace = StepTrace.from_env(worker.worker_id)  # diagnostics, off by default

    def start(self) -> None:
        self._writer.start()

    def close(self) -> None:
        self._writer.close()
        if self._trace is not None:
            self._trace.close()

    def has_pending(self) -> bool:
        return bool(self._pending) and self.engine.has_unfinished()

    def num_pending(self) -> int:
        return len(self._pending)

    def handle(self, message: Message) -> None:
        if isinstance(message, DecodeOrder):
            self._commit(message)
        elif isinstance(message, ReserveKv):
            self._pending.append(message)
            self._admit_pending()
        elif isinstance(message, Abort):
            rid = message.request_id
            self._pending = deque(o for o in self._pending if o.request_id != rid)
            if rid in self._reserved:
                self._reserved.discard(rid)
                if message.keep_reserved:  # its writer may be hung, not dead: never reuse them
                    log.warning("request %s: keeping its reserved KV blocks out of use until "
                                "its lost prefill worker is known dead", rid)
                    self._kept.add(rid)
                else:
                    self.engine.cancel_reserved(rid)
            elif rid in self._kept and not message.keep_reserved:  # the writer is dead now
                self._kept.discard(rid)
                self.engine.cancel_reserved(rid)
                log.info("request %s: its kept KV blocks are free again (writer dead)", rid)
            if rid in self._live:
                self._live.discard(rid)
                self.engine.abort(rid)

    def step(self) -> None:
        """One engine step; its new tokens for every live request go out as one write."""
        trace = self._trace
        if trace is not None:
            rows = [(s.request_id, s.num_tokens) for s in self.engine.batcher.running]
            t0, c0 = trace.now(), trace.cpu()
        tokens: list[Message] = []
        outputs = self.engine.step()
        if trace is not None:
            t1, c1 = trace.now(), trace.cpu()
        for output in outputs:
            if output.request_id not in self._live:
                continue
            reason = output.finish_reason.value if output.finish_reason else None
            tokens.append(Tokens(output.request_id, list(output.new_token_ids), reason,
                                 wire_logprobs(output.logprobs)))
            if output.finished:
                self._live.discard(output.request_id)
        self.worker.send_many(tokens)
        if trace is not None:
            trace.record(t0, t1, trace.now(), c1 - c0, rows)

    def after_step(self) -> None:
        self._admit_pending()

    def _admit_pending(self) -> None:
        while self._pending:
            order = self._pending[0]
            if self._reserve(order) is None:  # no room now: wait until running requests free
                if not self.engine.has_unfinished() and not self._reserved:
                    self._pending.popleft()
                    self.worker.send(RequestFailed(order.request_id, "decode worker: the KV "
                                                   "pool cannot hold this request"))
                    continue
                return
            self._pending.popleft()

    def _reserve(self, order: ReserveKv) -> bool | None:
        """True: reserved (KvReserved sent); False: refused (reported); None: no room now."""
        try:
            params = sampling_params(sampling_from_wire(order.sampling))
            block_ids = self.engine.reserve_request(order.request_id, order.prompt_token_ids,
                                                    params)
        except ValueError as exc:
            self.worker.send(RequestFailed(order.request_id, f"decode refused: {exc}"))
            return False
        if block_ids is None:
            return None
        self._reserved.add(order.request_id)
        pool = self.transfer.describe(self._pool_name)
        self.worker.send(KvReserved(order.request_id, pool.to_dict(),
                                    self.engine.pool.num_blocks, [int(b) for b in block_ids]))
        return True

    def _commit(self, order: DecodeOrder) -> None:
        rid = order.request_id
        if rid not in self._reserved:
            self.worker.send(RequestFailed(rid, "decode refused: no reserved KV blocks"))
            return
        try:
            self.engine.commit_reserved(rid, order.first_token_id, order.sampler_state)
        except ValueError as exc:
            self._reserved.discard(rid)
            self.engine.cancel_reserved(rid)
            self.worker.send(RequestFailed(rid, f"decode refused: {exc}"))
            return
        self._reserved.discard(rid)
        self._live.add(rid)
        self.worker.send(DecodeAdmitted(rid))
        if order.store_prompt:  # a CPP group's prompt: its blocks meet whole only here
            self._writer.write_prompt(order.prompt_token_ids)
