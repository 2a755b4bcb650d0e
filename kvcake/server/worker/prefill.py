"""The prefill side of a worker (and the colocated baseline): the first three of the four steps.

Lifecycle of one `PrefillOrder` on the engine-loop thread:
  1. prefix reuse: blocks the Conductor planned to fetch are read from the store
     (`namespace:key_hex`, verified by the store client) on the fetcher thread while the engine
     keeps stepping, then imported into the prefix cache on the engine thread;
     a failed or partial fetch only shortens the reused prefix (the rest is recomputed, so the
     tokens are the same);
  2. `add_request(prefill_only=True)`: the engine reuses the cached prefix and prefills the
     rest, in chunks of max_num_batched_tokens; when it schedules the first chunk the worker
     reports `PrefillStarted` (the Conductor's queue of this worker runs it down from then);
  3. during each step, `layer_hook(l)` submits an asynchronous write of layer l of the
     request's blocks straight into the blocks the decode engine reserved (its KV pool
     segment) while layer l+1 computes (per request, `handoff.py`'s `HandoffPolicy` sends it
     all after the prefill instead when that takes under 10 ms at the bandwidth measured on
     earlier hand-offs); after the step that sampled the first token the loop waits for what is still in
     flight (the exposed transfer time), reports `PrefillDone`, frees the blocks, and hands the
     prompt's full blocks to the store-writer thread, which puts them into the store
     asynchronously and reports them (`StoreEvents`).
An order without target blocks is a colocated request: it decodes here and streams `Tokens`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvcake.engine.engine import RequestOutput
from kvcake.engine.sequence import FinishReason
from kvcake.engine.step_trace import StepTrace
from kvcake.server.worker.block_fetch import StoredLayout, read_layers
from kvcake.server.worker.config import Role
from kvcake.server.worker.handoff import HandoffPolicy
from kvcake.server.worker.kv_runs import block_runs
from kvcake.server.worker.messages import (
    Abort,
    Message,
    PrefillDone,
    PrefillOrder,
    PrefillStarted,
    RequestFailed,
    Tokens,
    sampling_from_wire,
)
from kvcake.server.worker.role import RoleHost, sampling_params, wire_logprobs
from kvcake.server.worker.store_writer import StoreWriter
from kvcake.transfer import (
    SegmentDesc,
    TransferError,
    TransferOp,
    TransferRequest,
)
from kvcake.types import BlockKey

log = logging.getLogger(__name__)

_TRANSFER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _Fetched:
    """What the fetcher thread read for an order (size None: not in the store)."""

    order: PrefillOrder
    sizes: list[int | None]
    buffers: list[bytearray]
    seconds: float = 0.0  # the store read's wall time (bytes: the sizes read)


@dataclass
class _Prefill:
    order: PrefillOrder
    kv_pool: SegmentDesc | None  # the decode engine's pool; None: colocated (decode here)
    num_fetched_tokens: int
    fetch_bytes: int = 0  # read from the store for this prefill, in fetch_s seconds
    fetch_s: float = 0.0
    blocks_done: int = 0  # leading blocks fully streamed in earlier steps
    step_end_block: int = 0  # blocks this step may write (set at layer 0 of each step)
    batches: list[Any] = field(default_factory=list)
    first_submit_s: float | None = None
    compute_s: float = 0.0
    transfer_bytes: int = 0
    first_token_sent: bool = False
    layerwise: bool = False  # stream during the prefill (else after it): `HandoffPolicy`
    started: bool = False  # `PrefillStarted` sent: the engine scheduled its first chunk


class PrefillRole:
    def __init__(self, worker: RoleHost) -> None:
        self.worker = worker
        assert worker.engine is not None and worker.transfer is not None
        self.engine = worker.engine
        self.transfer = worker.transfer
        self._live: dict[str, _Prefill] = {}
        self._handoff = HandoffPolicy()  # per request: layer-wise or after the prefill
        self._writer = StoreWriter(worker, self.engine)
        self._in_step: list[_Prefill] = []  # requests in the step now running (set at layer 0)
        self._fetches: queue.Queue[PrefillOrder | None] = queue.Queue()
        self._fetching: dict[str, PrefillOrder] = {}  # handed to the fetcher, not started
        self._fetcher: threading.Thread | None = None
        # diagnostics, off by default: a colocated worker's mixed steps (decode rows + chunks)
        self._trace = (StepTrace.from_env(worker.worker_id)
                       if worker.config.role is Role.COLOCATED else None)
        self._traced: list[tuple[Any, int, int]] = []  # (sequence, tokens, computed) at layer 0

    # -- the role contract (role.py) ---------------------------------------------------
    def start(self) -> None:
        self._writer.start()
        if self.worker.store is not None:
            self._fetcher = threading.Thread(target=self._fetch_loop, daemon=True,
                                             name=f"{self.worker.worker_id}-fetcher")
            self._fetcher.start()

    def close(self) -> None:
        self._writer.close()
        if self._fetcher is not None:
            self._fetches.put(None)
            self._fetcher.join(timeout=10)
        if self._trace is not None:
            self._trace.close()

    def has_pending(self) -> bool:
        return False

    def num_pending(self) -> int:
        return len(self._fetching)

    def handle(self, message: Message | _Fetched) -> None:
        if isinstance(message, PrefillOrder):
            self._admit(message)
        elif isinstance(message, _Fetched):
            if self._fetching.pop(message.order.request_id, None) is not None:
                self._start(message.order, message)
        elif isinstance(message, Abort):
            if self._fetching.pop(message.request_id, None) is not None:
                self.worker.send(RequestFailed(message.request_id, "aborted"))
                return
            state = self._live.pop(message.request_id, None)
            if state is not None:
                self.engine.abort(message.request_id)
                # The ack tells the frontend nothing writes the reserved blocks any more.
                self._wait_transfers(state)
                self.worker.send(RequestFailed(message.request_id, "aborted"))

    def step(self) -> None:
        trace = self._trace
        if trace is not None:
            t0, c0 = trace.now(), trace.cpu()
            self._traced = []
        before = time.perf_counter()
        self._in_step = []
        outputs = self.engine.step(layer_hook=self._layer_hook)
        spent = time.perf_counter() - before
        if trace is not None:
            t1, c1 = trace.now(), trace.cpu()
        for state in self._in_step:
            state.compute_s += spent
        for output in outputs:
            self._on_output(output)
        self._note_progress()
        if trace is not None and self._traced:
            self._record_step(trace, t0, t1, c1 - c0)

    def _record_step(self, trace: StepTrace, t0: float, t1: float, cpu_s: float) -> None:
        """The step's decode rows and prompt chunks (what each sequence computed in it)."""
        rows, chunks = [], []
        for seq, tokens, computed in self._traced:
            done = seq.num_computed_tokens - computed
            if done <= 0:
                continue  # not scheduled in this step
            if computed >= seq.num_prompt_tokens:
                rows.append((seq.request_id, tokens))
            else:
                chunks.append((seq.request_id, computed, done, seq.num_prompt_tokens))
        trace.record(t0, t1, trace.now(), cpu_s, rows, chunks)

    def after_step(self) -> None:
        pass

    # -- step 1: prefix reuse ----------------------------------------------------------------
    def _admit(self, order: PrefillOrder) -> None:
        try:
            sampling_params(sampling_from_wire(order.sampling))
        except ValueError as exc:
            self.worker.send(RequestFailed(order.request_id, f"prefill refused: {exc}"))
            return
        if order.fetch_keys and self.worker.store is not None:
            # The store read runs on the fetcher thread, so the engine keeps computing.
            self._fetching[order.request_id] = order
            self._fetches.put(order)
        else:
            self._start(order, None)

    def _start(self, order: PrefillOrder, fetched: _Fetched | None) -> None:
        rid = order.request_id
        try:
            params = sampling_params(sampling_from_wire(order.sampling))
            num_fetched = self._import(fetched) if fetched is not None else 0
            kv_pool = _kv_pool(order)
            self.engine.add_request(rid, order.prompt_token_ids, params,
                                    prefill_only=kv_pool is not None)
        except (ValueError, KeyError) as exc:
            self.worker.send(RequestFailed(rid, f"prefill refused: {exc}"))
            return
        fetch_bytes = sum(size for size in fetched.sizes if size is not None) \
            if fetched is not None else 0
        state = _Prefill(order, kv_pool, num_fetched, fetch_bytes,
                         fetched.seconds if fetched is not None else 0.0)
        if kv_pool is not None and self.worker.config.layerwise:
            state.layerwise = self._handoff.layerwise(
                len(order.target_blocks) * self.engine.pool.block_nbytes)
        self._live[rid] = state

    def _fetch_loop(self) -> None:
        store = self.worker.store
        assert store is not None
        ns, nbytes = self.engine.namespace, self.engine.pool.block_nbytes
        num_layers = self.engine.model_config.num_layers
        while (order := self._fetches.get()) is not None:
            # whole blocks, else the layer slices a CPP group's stages stored (block_fetch.py)
            bounds = order.fetch_layer_bounds
            split = tuple(range(a, b) for a, b in zip(bounds, bounds[1:], strict=False))
            layout = StoredLayout(ns, nbytes // num_layers, num_layers, split)
            read = read_layers(store, layout, order.fetch_keys, range(num_layers),
                               self.worker.worker_id)
            self.worker.post(_Fetched(order, read.sizes, read.buffers, read.seconds))

    def _import(self, fetched: _Fetched) -> int:
        """Import the longest usable prefix of the fetched blocks; returns its tokens."""
        imported = 0
        for key, size, data in zip(fetched.order.fetch_keys, fetched.sizes, fetched.buffers,
                                   strict=True):
            cached = self.engine.block_manager.lookup(BlockKey(key)) is not None
            if not cached and (size != len(data)
                               or not self.engine.import_block_kv(BlockKey(key), bytes(data))):
                break  # later blocks are useless without this one
            imported += not cached
        return imported * self.engine.block_size

    # -- step 3: layer-wise streaming ---------------------------------------------------------
    def _layer_hook(self, layer_idx: int) -> None:
        """Layer `layer_idx` of every streaming request's blocks is written: ship it now."""
        if layer_idx == 0:
            self._start_step()
            if self._trace is not None:  # scheduled, not yet computed: each one's start
                self._traced = [(seq, seq.num_tokens, seq.num_computed_tokens)
                                for seq in self.engine.batcher.running]
        for state in self._in_step:
            if state.kv_pool is not None and state.layerwise and not state.first_token_sent:
                self._submit_layer(state, layer_idx, state.blocks_done, state.step_end_block)

    def _start_step(self) -> None:
        """Which prefills this step runs, and the blocks each may write: at most the step's
        token budget past what was computed before (exact for one request per step; more
        requests share the budget, and a block sent unfinished is sent again next step)."""
        budget = self.engine.config.max_num_batched_tokens
        bs = self.engine.block_size
        self._in_step = []
        for seq in self.engine.batcher.running:
            state = self._live.get(seq.request_id)
            if state is not None:
                end = min(seq.num_prompt_tokens, seq.num_computed_tokens + budget)
                state.step_end_block = -(-end // bs)
                self._in_step.append(state)
                if not state.started:  # its first chunk: the Conductor's queue clock starts
                    state.started = True
                    self.worker.send(PrefillStarted(seq.request_id))

    def _submit_layer(self, state: _Prefill, layer_idx: int, first_block: int,
                      end_block: int) -> None:
        pool = self.engine.pool
        kv_pool = state.kv_pool
        assert kv_pool is not None
        block_ids = self.engine.request_block_ids(state.order.request_id)
        targets = state.order.target_blocks
        num_pool_blocks = state.order.num_pool_blocks
        # KV written into a decode engine's blocks has no end-to-end check (a store object has):
        # where it crosses TCP, each slice carries a digest the decode side verifies; a memcpy
        # into a same-host pool's shared memory follows the engine's `checksum_shm` (off).
        # One request per run of consecutive blocks at both ends (`block_runs`), not per block.
        runs = block_runs(block_ids, targets, first_block, end_block)
        requests = [
            TransferRequest(TransferOp.WRITE, pool.kv[layer_idx, src:src + n], kv_pool,
                            (layer_idx * num_pool_blocks + dst) * pool.layer_nbytes,
                            checksum_tcp=True)
            for src, dst, n in runs]
        if not requests:
            return
        if state.first_submit_s is None:
            state.first_submit_s = time.perf_counter()
        state.batches.append(self.transfer.submit(requests))
        state.transfer_bytes += sum(n for _, _, n in runs) * pool.layer_nbytes

    def _note_progress(self) -> None:
        bs = self.engine.block_size
        for seq in self.engine.batcher.running:
            state = self._live.get(seq.request_id)
            if state is not None:
                state.blocks_done = seq.num_computed_tokens // bs

    # -- the end of a prefill ----------------------------------------------------------------
    def _on_output(self, output: RequestOutput) -> None:
        rid = output.request_id
        state = self._live.get(rid)
        if state is None:
            return
        if state.first_token_sent:  # colocated: decode tokens
            reason = output.finish_reason.value if output.finish_reason else None
            self.worker.send(Tokens(rid, list(output.new_token_ids), reason,
                                    wire_logprobs(output.logprobs)))
            if output.finished:
                del self._live[rid]
            return
        state.first_token_sent = True
        ended = time.perf_counter()
        if state.kv_pool is not None and not state.layerwise:
            for layer_idx in range(self.engine.pool.num_layers):
                self._submit_layer(state, layer_idx, 0, len(state.order.target_blocks))
        had_transfers = bool(state.batches)
        error = self._wait_transfers(state)
        exposed_s = time.perf_counter() - ended
        if had_transfers and not state.layerwise and error is None:
            self._handoff.observe(state.transfer_bytes, exposed_s)
        span_s = time.perf_counter() - (state.first_submit_s or ended)
        self._writer.write_prompt(state.order.prompt_token_ids)
        sampler_state = self.engine.sampler_state(rid) if state.kv_pool is not None else None
        if state.kv_pool is not None:
            self.engine.release(rid)
            del self._live[rid]
        if error is not None:
            self.worker.send(RequestFailed(rid, f"KV transfer to the decode worker failed: "
                                                f"{error}"))
            self.engine.abort(rid)
            self._live.pop(rid, None)
            return
        finish = output.finish_reason
        final = None if finish is None or finish is FinishReason.PREFILL_DONE else finish.value
        self.worker.send(PrefillDone(
            rid, output.new_token_ids[0], final, output.num_cached_tokens,
            state.num_fetched_tokens, state.compute_s, span_s if had_transfers else 0.0,
            exposed_s if had_transfers else 0.0, state.transfer_bytes, sampler_state,
            wire_logprobs(output.logprobs), state.fetch_bytes, state.fetch_s,
            None if output.prompt_logprobs is None else
            [None, *(wire_logprobs(output.prompt_logprobs[1:]) or [])]))
        if output.finished:
            self._live.pop(rid, None)

    def _wait_transfers(self, state: _Prefill) -> str | None:
        error = None
        for batch in state.batches:
            try:
                self.transfer.wait(batch, _TRANSFER_TIMEOUT_S).raise_for_failure()
            except TransferError as exc:
                error = str(exc)
        state.batches.clear()
        return error


def _kv_pool(order: PrefillOrder) -> SegmentDesc | None:
    """The decode engine's KV pool the order's KV goes into; None for a colocated order."""
    if not order.target_blocks:
        return None
    if order.num_pool_blocks < 1:
        raise ValueError(f"num_pool_blocks: must be >= 1 with target blocks, got "
                         f"{order.num_pool_blocks}")
    if not all(-1 <= b < order.num_pool_blocks for b in order.target_blocks):
        raise ValueError(f"target_blocks: each must be -1 or a block of the decode pool "
                         f"(< {order.num_pool_blocks})")
    return SegmentDesc.from_dict(order.kv_pool)
