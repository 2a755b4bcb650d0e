"""One rail: a thread that moves slices over its own pool of endpoints (one per peer).

Each rail owns its endpoints, as each NIC owns its queue pairs in the paper's engine, so no
endpoint is ever shared between threads. The pool is bounded; SIEVE picks the endpoint to close.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvcake.transfer.batch import Batch
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.errors import TransportError
from kvcake.transfer.plan import RailPreference, Slice
from kvcake.transfer.request import TransferOp
from kvcake.transfer.segment import SegmentDesc
from kvcake.transfer.sieve import SieveCache
from kvcake.transfer.transport import EndpointKey, Transport

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
    def __init__(self, rail: int, connect: Callable[[EndpointKey, int], Transport],
                 max_endpoints: int,
                 on_failure: Callable[[SliceTask, TransportError], None]) -> None:
        self.rail = rail
        self._connect = connect
        self._on_failure = on_failure
        self._pool: SieveCache[EndpointKey, Transport] = SieveCache(max_endpoints)
        self._queue: queue.SimpleQueue[SliceTask | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

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

    def run_one(self, task: SliceTask) -> None:
        """Move one slice on the calling thread (the rail's own, or an inline caller's)."""
        if task.batch.has_failed(task.slice.request_index):
            task.batch.slice_skipped(task.slice.request_index)
            return
        try:
            self._execute(task)
        except TransportError as e:
            self._drop(task.request.endpoint)
            self._on_failure(task, e)
        except Exception as e:  # a bug must fail the request, not kill the rail
            log.exception("rail %d: slice failed unexpectedly", self.rail)
            task.batch.slice_failed(task.slice.request_index, f"internal error: {e!r}")

    def _run(self) -> None:
        while (task := self._queue.get()) is not None:
            self.run_one(task)

    def _execute(self, task: SliceTask) -> None:
        request, piece = task.request, task.slice
        transport = self._endpoint(request.endpoint)
        local = request.local[piece.local_offset:piece.local_offset + piece.length]
        kind = request.checksum
        if request.op is TransferOp.READ:
            digest = transport.read(request.segment, piece.remote_offset, local, checksum=kind)
            if kind is not None and kind.compute(local) != digest:
                raise TransportError(f"checksum mismatch reading {request.segment.name!r} "
                                     f"[{piece.remote_offset}, +{piece.length})")
        else:
            digest = kind.compute(local) if kind is not None else None
            transport.write(request.segment, piece.remote_offset, local, checksum=kind,
                            digest=digest)
        task.batch.slice_done(piece.request_index, piece.length)

    def _endpoint(self, key: EndpointKey) -> Transport:
        transport = self._pool.get(key)
        if transport is None:
            transport = self._connect(key, self.rail)
            for _, evicted in self._pool.put(key, transport):
                evicted.close()
        return transport

    def _drop(self, key: EndpointKey) -> None:
        transport = self._pool.pop(key)
        if transport is not None:
            transport.close()
