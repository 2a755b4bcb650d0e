"""One rail: a thread that moves slices over its own pool of endpoints (one per peer).

Each rail owns its endpoints, as each NIC owns its queue pairs in the paper's engine, so no
endpoint is ever shared between threads. The pool is bounded; SIEVE picks the endpoint to close.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from kvcake.transfer.batch import Batch
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.errors import TransportError
from kvcake.transfer.plan import RailPreference, Slice
from kvcake.transfer.request import TransferOp
from kvcake.transfer.segment import SegmentDesc
from kvcake.transfer.sieve import SieveCache
from kvcake.transfer.transport import EndpointKey, PipelinedTransport, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    """A validated request: what every one of its slices needs."""

    op: TransferOp
    local: memoryview
    segment: SegmentDesc
    endpoint: EndpointKey
    checksum: ChecksumKind | None
    preference: RailPreference


@dataclass(frozen=True)
class SliceTask:
    batch: Batch
    request: Resolved
    slice: Slice
    attempt: int  # 0 for the first try


class RailWorker:
    """Moves slices over its endpoints, keeping up to `pipeline_depth` of them in flight.

    Over a pipelined transport (TCP) the rail sends the next requests (and a write's bytes) before
    the reply to the first one is in, so the connection keeps streaming while this thread checks a
    slice's digest or computes the next one's; over other transports it moves one slice per call.
    A lost connection loses every slice in flight on it: each is retried on another rail. A slice
    the peer rejects, or whose bytes fail their check, fails alone and the connection stays.
    """

    def __init__(self, rail: int, connect: Callable[[EndpointKey, int], Transport],
                 max_endpoints: int,
                 on_failure: Callable[[SliceTask, TransportError], None],
                 pipeline_depth: int = 1) -> None:
        self.rail = rail
        self._connect = connect
        self._on_failure = on_failure
        self._depth = pipeline_depth
        self._pool: SieveCache[EndpointKey, Transport] = SieveCache(max_endpoints)
        self._queue: queue.SimpleQueue[SliceTask | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Slices in flight, per endpoint, by the token its transport gave them; endpoints in the
        # order they were first used, so the oldest slice is settled first.
        self._in_flight: dict[EndpointKey, tuple[PipelinedTransport, dict[int, SliceTask]]] = {}
        self._num_in_flight = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvcake-rail-{self.rail}",
                                        daemon=True)
        self._thread.start()

    def submit(self, task: SliceTask) -> None:
        self._queue.put(task)

    def close(self) -> None:
        """Finish queued slices, then close every endpoint."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for key in self._pool.keys():
            transport = self._pool.pop(key)
            if transport is not None:
                transport.close()

    def endpoint_keys(self) -> list[EndpointKey]:
        """Keys of the pooled endpoints, oldest first (for tests and stats)."""
        return self._pool.keys()

    def run_all(self, tasks: Sequence[SliceTask]) -> None:
        """Move slices on the calling thread (an inline caller's), pipelined, and settle them all
        before returning."""
        for task in tasks:
            while self._num_in_flight >= self._depth:
                self._settle_next()
            self._issue(task)
        while self._num_in_flight:
            self._settle_next()

    def run_one(self, task: SliceTask) -> None:
        """Move one slice on the calling thread and settle it."""
        self.run_all((task,))

    def _run(self) -> None:
        """Block for work only when nothing is in flight; otherwise top the pipeline up with what
        is queued, then settle the oldest endpoint's next reply."""
        while (task := self._queue.get()) is not None:
            self._issue(task)
            while self._num_in_flight:
                while self._num_in_flight < self._depth:
                    try:
                        task = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if task is None:
                        self.run_all(())  # settle what is in flight, then stop
                        return
                    self._issue(task)
                self._settle_next()

    def _issue(self, task: SliceTask) -> None:
        """Start one slice (pipelined) or move it (otherwise); failures go to `_on_failure`."""
        if task.batch.has_failed(task.slice.request_index):
            task.batch.slice_skipped(task.slice.request_index)
            return
        key = task.request.endpoint
        try:
            transport = self._endpoint(key)
            if getattr(transport, "pipelined", False):
                self._start(cast(PipelinedTransport, transport), task)
            else:
                self._execute(transport, task)
        except TransportError as e:
            self._lose(key, e, task)
        except Exception as e:  # a bug must fail the request, not kill the rail
            log.exception("rail %d: slice failed unexpectedly", self.rail)
            task.batch.slice_failed(task.slice.request_index, f"internal error: {e!r}")

    def _start(self, transport: PipelinedTransport, task: SliceTask) -> None:
        request, piece = task.request, task.slice
        local = request.local[piece.local_offset:piece.local_offset + piece.length]
        kind = request.checksum
        if request.op is TransferOp.READ:
            token = transport.start_read(request.segment, piece.remote_offset, local, checksum=kind)
        else:  # with a checksum, the transport digests the bytes as it sends them
            token = transport.start_write(request.segment, piece.remote_offset, local,
                                          checksum=kind, digest=None)
        entry = self._in_flight.setdefault(request.endpoint, (transport, {}))
        entry[1][token] = task
        self._num_in_flight += 1

    def _settle_next(self) -> None:
        key, (transport, tasks) = next(iter(self._in_flight.items()))
        try:
            done = transport.next_completion()
        except TransportError as e:
            self._lose(key, e, None)
            return
        task = tasks.pop(done.token, None)
        self._num_in_flight -= 1
        if not tasks:
            del self._in_flight[key]
        if task is None:  # the transport broke its contract: trust nothing more from it
            self._lose(key, TransportError(f"completion {done.token} matches no slice"), None)
            return
        try:
            if done.error is not None:
                raise done.error
            if not done.verified:
                self._check(task, done.digest)
        except TransportError as e:
            self._on_failure(task, e)
            return
        task.batch.slice_done(task.slice.request_index, task.slice.length)

    def _execute(self, transport: Transport, task: SliceTask) -> None:
        request, piece = task.request, task.slice
        local = request.local[piece.local_offset:piece.local_offset + piece.length]
        kind = request.checksum
        if request.op is TransferOp.READ:
            digest = transport.read(request.segment, piece.remote_offset, local, checksum=kind)
            self._check(task, digest)
        else:
            digest = kind.compute(local) if kind is not None else None
            transport.write(request.segment, piece.remote_offset, local, checksum=kind,
                            digest=digest)
        task.batch.slice_done(piece.request_index, piece.length)

    @staticmethod
    def _check(task: SliceTask, digest: int | None) -> None:
        """A read's bytes against the digest their source sent (writes are checked remotely)."""
        request, piece = task.request, task.slice
        kind = request.checksum
        if request.op is not TransferOp.READ or kind is None:
            return
        local = request.local[piece.local_offset:piece.local_offset + piece.length]
        if kind.compute(local) != digest:
            raise TransportError(f"checksum mismatch reading {request.segment.name!r} "
                                 f"[{piece.remote_offset}, +{piece.length})")

    def _lose(self, key: EndpointKey, error: TransportError, task: SliceTask | None) -> None:
        """The endpoint failed: close it; `task` and every slice in flight on it are retried (or
        fail, when the error says retrying cannot help)."""
        lost = [task] if task is not None else []
        entry = self._in_flight.pop(key, None)
        if entry is not None:
            lost.extend(entry[1].values())
            self._num_in_flight -= len(entry[1])
        self._drop(key)
        for each in lost:
            self._on_failure(each, error)

    def _endpoint(self, key: EndpointKey) -> Transport:
        transport = self._pool.get(key)
        if transport is None:
            transport = self._connect(key, self.rail)
            for evicted_key, evicted in self._pool.put(key, transport):
                while evicted_key in self._in_flight:  # settle its slices before closing it
                    self._settle_evicted(evicted_key)
                evicted.close()
        return transport

    def _settle_evicted(self, key: EndpointKey) -> None:
        # move the evicted endpoint to the front, so _settle_next works on it
        entry = self._in_flight.pop(key)
        self._in_flight = {key: entry, **self._in_flight}
        self._settle_next()

    def _drop(self, key: EndpointKey) -> None:
        transport = self._pool.pop(key)
        if transport is not None:
            transport.close()
