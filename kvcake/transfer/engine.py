"""The transfer engine: registered segments, batched sliced transfers striped over rails.

Lifecycle of a batch:
  submit(requests)  validates every request (ValueError names the bad field), resolves each to an
                    endpoint (shared memory when the segment is on this host, else TCP), cuts it
                    into slices and deals them over the rails of the segment's preference;
  rail threads      move their slices; a slice failing on a path fault goes to the next rail of
                    its order, at most `max_retries` times, then its request FAILS;
  status / wait     report per-request state (pending / done / failed) and bytes done.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from kvcake.transfer import checksum
from kvcake.transfer.batch import Batch
from kvcake.transfer.config import TransferConfig
from kvcake.transfer.errors import TransferError, TransferTimeout, TransportError
from kvcake.transfer.plan import RailPreference, plan_slices, retry_rail, validate_preference
from kvcake.transfer.rail import RailWorker, Resolved, SliceTask
from kvcake.transfer.request import BatchId, BatchStatus, TransferOp, TransferRequest
from kvcake.transfer.segment import (
    Segment,
    SegmentDesc,
    SharedBlock,
    buffer_view,
    local_host_id,
    private_block,
)
from kvcake.transfer.server import SegmentServer
from kvcake.transfer.shm import ShmTransport
from kvcake.transfer.tcp import TcpTransport
from kvcake.transfer.transport import EndpointKey, Transport, TransportKind, TransportWrapper


class TransferEngine:
    """One process's transfer engine. Construct, `start()`, use, `close()` (or `with`)."""

    def __init__(self, config: TransferConfig | None = None, *,
                 wrap_transport: TransportWrapper | None = None) -> None:
        self.config = config or TransferConfig()
        self._wrap = wrap_transport
        self._checksum_kind = checksum.parse(self.config.checksum, "TransferConfig.checksum")
        self._segments: dict[int, Segment] = {}
        # Ids start at a random point so that a restarted owner never gives an old id to new
        # memory: a stale descriptor gets UNKNOWN_SEGMENT instead of someone else's bytes.
        self._segment_ids = itertools.count((int.from_bytes(os.urandom(3), "big") << 8) + 1)
        self._batch_ids = itertools.count(1)
        self._batches: dict[int, Batch] = {}
        self._preferences: dict[str, RailPreference] = {}
        self._default_pref = RailPreference(tuple(range(self.config.num_rails)))
        self._cursor = 0
        self._lock = threading.Lock()
        depth = self.config.pipeline_depth
        self._rails = [RailWorker(r, self._connect, self.config.max_endpoints_per_rail,
                                  self._on_slice_failure, depth)
                       for r in range(self.config.num_rails)]
        # Endpoints of the caller-thread fast path: one caller at a time, under the lock.
        self._inline = RailWorker(0, self._connect, self.config.max_endpoints_per_rail,
                                  self._on_slice_failure, depth)
        self._inline_lock = threading.Lock()
        self._server: SegmentServer | None = None
        self._started = False
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the rail threads and, when `config.serve`, the segment server."""
        if self._started:
            raise RuntimeError("transfer engine already started")
        if self.config.serve:
            self._server = SegmentServer(self._segments, host=self.config.host,
                                         port=self.config.port,
                                         port_search=self.config.port_search,
                                         buffer_bytes=self.config.socket_buffer_bytes,
                                         secret=self.config.secret)
            self._server.start()
        for rail in self._rails:
            rail.start()
        self._started = True

    def close(self) -> None:
        """Finish queued slices, stop rails and server, release segments this engine allocated.

        Slices that fail while closing are not retried: their requests fail."""
        self._closing = True
        for rail in self._rails:
            rail.close()
        with self._inline_lock:
            self._inline.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        for segment in list(self._segments.values()):
            segment.release()
        self._segments.clear()
        self._started = False
        self._closing = False

    def __enter__(self) -> TransferEngine:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def address(self) -> str:
        """"host:port" peers dial for this engine's segment server: `advertise_host` if set,
        else the bind host ("" when not serving or not started)."""
        if self._server is None:
            return ""
        if self.config.advertise_host:
            return f"{self.config.advertise_host}:{self._server.address.rpartition(':')[2]}"
        return self._server.address

    # -- segments ----------------------------------------------------------------------------
    def register_segment(self, name: str, memory: Any) -> SegmentDesc:
        """Serve `memory` (numpy / CPU torch / bytearray / SharedMemory) as segment `name`.

        The caller keeps ownership of the memory and must keep it alive until unregistering.
        Raises ValueError for a duplicate name or memory that is not a flat writable buffer.
        The descriptor carries the server address once the engine is started (`describe(name)`
        gives the current one).
        """
        with self._lock:
            if any(s.name == name for s in self._segments.values()):
                raise ValueError(f"segment {name!r} is already registered; unregister it first "
                                 f"or pick another name")
            segment = Segment(name, next(self._segment_ids), memory)
            self._segments[segment.segment_id] = segment
        return segment.desc(self.address)

    def allocate_segment(self, name: str, length_bytes: int, *, shared: bool = True) -> SegmentDesc:
        """Allocate zeroed, page-aligned memory and register it; shared memory lets same-host
        peers map it. Page-aligned because the kernel copies a TCP payload fastest between buffers
        aligned alike (a numpy array starts 16 bytes into a page: writes out of one cost ~1.5x
        the CPU per GB here with several rails; see docs/benchmarks.md).

        The engine owns this memory: it is freed (and unlinked) on unregister or close.
        """
        if not isinstance(length_bytes, int) or length_bytes <= 0:
            raise ValueError(f"length_bytes must be a positive integer, got {length_bytes!r}")
        with self._lock:
            if any(s.name == name for s in self._segments.values()):
                raise ValueError(f"segment {name!r} is already registered; pick another name")
            if shared:
                shm = SharedBlock(length_bytes)
                segment = Segment(name, next(self._segment_ids), shm.mapping, owned_shm=shm)
            else:
                segment = Segment(name, next(self._segment_ids), private_block(length_bytes))
            self._segments[segment.segment_id] = segment
        return segment.desc(self.address)

    def unregister_segment(self, name: str) -> None:
        """Stop serving `name`; KeyError if it is not registered."""
        with self._lock:
            segment = self.segment(name)
            del self._segments[segment.segment_id]
        segment.release()

    def segment(self, name: str) -> Segment:
        """The local segment `name` (its `.view` / `.array` are the memory); KeyError if absent."""
        for segment in list(self._segments.values()):
            if segment.name == name:
                return segment
        raise KeyError(f"no local segment named {name!r}")

    def describe(self, name: str) -> SegmentDesc:
        """The descriptor peers use to reach local segment `name`."""
        return self.segment(name).desc(self.address)

    def local_view(self, name: str, offset: int = 0, length: int | None = None) -> memoryview:
        """A window of a local segment, usable as the buffer of a request."""
        view = self.segment(name).view
        end = len(view) if length is None else offset + length
        if offset < 0 or end > len(view) or end <= offset:
            raise ValueError(f"window [{offset}, {end}) is not inside segment {name!r} "
                             f"of {len(view)} bytes")
        return view[offset:end]

    def lookup(self, address: str, name: str) -> SegmentDesc:
        """Ask the segment server at `address` for its segment `name` (TransferError if absent)."""
        transport = TcpTransport.connect(address, timeout_s=self.config.io_timeout_s,
                                         buffer_bytes=self.config.socket_buffer_bytes,
                                         secret=self.config.secret)
        try:
            return transport.lookup(name)
        except TransportError as e:
            raise TransferError(str(e)) from e
        finally:
            transport.close()

    def set_rail_preference(self, segment_name: str, preferred: Sequence[int],
                            secondary: Sequence[int] = ()) -> None:
        """Topology for transfers to/from segments named `segment_name`: stripe over `preferred`
        rails, fall back on `secondary` ones. Default: every rail preferred."""
        pref = RailPreference(tuple(preferred), tuple(secondary))
        validate_preference(pref, self.config.num_rails)
        self._preferences[segment_name] = pref

    # -- transfers ---------------------------------------------------------------------------
    def submit(self, requests: Sequence[TransferRequest]) -> BatchId:
        """Start moving a batch; returns at once. ValueError (naming the request and field) if
        any request is invalid, in which case nothing of the batch is started."""
        batch_id, tasks = self._prepare(requests)
        for task in tasks:
            self._rails[task.slice.rail].submit(task)
        return batch_id

    def _prepare(self, requests: Sequence[TransferRequest]) -> tuple[BatchId, list[SliceTask]]:
        if not self._started:
            raise RuntimeError("transfer engine not started; call start() first")
        if not requests:
            raise ValueError("a batch needs at least one request")
        resolved = [self._resolve(i, r) for i, r in enumerate(requests)]
        with self._lock:
            batch_id = BatchId(next(self._batch_ids))
            slices, self._cursor = plan_slices(
                [(r.remote_offset, len(v.local), v.preference)
                 for r, v in zip(requests, resolved, strict=True)],
                self.config.slice_bytes, self._cursor)
            counts = [0] * len(requests)
            for piece in slices:
                counts[piece.request_index] += 1
            batch = Batch(batch_id, [len(v.local) for v in resolved], counts)
            self._batches[batch_id] = batch
        return batch_id, [SliceTask(batch, resolved[p.request_index], p, 0) for p in slices]

    def status(self, batch_id: BatchId) -> BatchStatus:
        """A snapshot of the batch; KeyError once `wait` has returned it finished."""
        return self._batch(batch_id).status()

    def wait(self, batch_id: BatchId, timeout_s: float | None = None) -> BatchStatus:
        """Block until every request of the batch is done or failed, and forget the batch.

        Failures are in the returned status (`raise_for_failure()` turns them into a
        TransferError). Raises TransferTimeout if `timeout_s` passes first; the batch keeps
        running and can be waited on again.
        """
        batch = self._batch(batch_id)
        if not batch.wait(timeout_s):
            status = batch.status()
            raise TransferTimeout(f"batch {batch_id} not finished after {timeout_s} s "
                                  f"({status.bytes_done} bytes done)")
        with self._lock:
            self._batches.pop(batch_id, None)
        return batch.status()

    def transfer(self, requests: Sequence[TransferRequest], timeout_s: float | None = None) -> None:
        """Submit and wait; TransferError if any request failed.

        A batch of at most `config.inline_max_slices` slices moves on this thread (when no other
        caller is using the inline endpoints); `timeout_s` then bounds only the retries, each
        inline socket call being bounded by `config.io_timeout_s`."""
        batch_id, tasks = self._prepare(requests)
        if len(tasks) <= self.config.inline_max_slices and self._inline_lock.acquire(False):
            try:
                self._inline.run_all(tasks)
            finally:
                self._inline_lock.release()
        else:
            for task in tasks:
                self._rails[task.slice.rail].submit(task)
        self.wait(batch_id, timeout_s).raise_for_failure()

    def read(self, segment: SegmentDesc, remote_offset: int, buffer: Any,
             timeout_s: float | None = None) -> None:
        """Fill `buffer` from `segment` at `remote_offset` (synchronous)."""
        self.transfer([TransferRequest(TransferOp.READ, buffer, segment, remote_offset)], timeout_s)

    def write(self, segment: SegmentDesc, remote_offset: int, buffer: Any,
              timeout_s: float | None = None) -> None:
        """Store `buffer` into `segment` at `remote_offset` (synchronous)."""
        self.transfer([TransferRequest(TransferOp.WRITE, buffer, segment, remote_offset)],
                      timeout_s)

    def endpoint_keys(self, rail: int) -> list[EndpointKey]:
        """The endpoints pooled on `rail`, oldest first."""
        return self._rails[rail].endpoint_keys()

    # -- internals ---------------------------------------------------------------------------
    def _batch(self, batch_id: BatchId) -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise KeyError(f"unknown batch {batch_id} (never submitted, or already waited on)")
        return batch

    def _resolve(self, index: int, request: TransferRequest) -> Resolved:
        where = f"request {index}"
        if not isinstance(request, TransferRequest) or not isinstance(request.op, TransferOp):
            raise ValueError(f"{where}: expected a TransferRequest with a TransferOp")
        segment = request.segment
        if not isinstance(segment, SegmentDesc):
            raise ValueError(f"{where}: segment must be a SegmentDesc, got {type(segment).__name__}")
        view = buffer_view(request.buffer, writable=request.op is TransferOp.READ,
                           field=f"{where}.buffer")
        length = len(view) if request.length is None else request.length
        if length <= 0:
            raise ValueError(f"{where}: length must be positive, got {length} (zero-length "
                             f"transfers are refused)")
        if length > len(view):
            raise ValueError(f"{where}: buffer holds {len(view)} bytes, less than length {length}")
        if request.remote_offset < 0 or request.remote_offset + length > segment.length_bytes:
            raise ValueError(f"{where}: remote range [{request.remote_offset}, "
                             f"{request.remote_offset + length}) is outside segment "
                             f"{segment.name!r} of {segment.length_bytes} bytes")
        endpoint = self._endpoint_for(segment, where)
        on = self.config.digests(endpoint.kind is TransportKind.TCP, request.checksum_tcp)
        checksum = self._checksum_kind if on else None
        pref = self._preferences.get(segment.name, self._default_pref)
        return Resolved(request.op, view[:length], segment, endpoint, checksum, pref)

    def _endpoint_for(self, segment: SegmentDesc, where: str) -> EndpointKey:
        if (self.config.use_shared_memory and segment.shm_name
                and segment.host_id == local_host_id()):
            return EndpointKey(TransportKind.SHM, segment.shm_name)
        if not segment.address:
            raise ValueError(f"{where}: segment {segment.name!r} has no server address and is not "
                             f"shared memory on this host; its owner must serve it")
        return EndpointKey(TransportKind.TCP, segment.address)

    def _connect(self, key: EndpointKey, rail: int) -> Transport:
        transport: Transport
        if key.kind is TransportKind.SHM:
            transport = ShmTransport.attach(key.peer)
        else:
            bind = self.config.rail_bind_hosts[rail] if self.config.rail_bind_hosts else None
            transport = TcpTransport.connect(key.peer, bind_host=bind,
                                             timeout_s=self.config.io_timeout_s,
                                             buffer_bytes=self.config.socket_buffer_bytes,
                                             secret=self.config.secret)
        return self._wrap(transport, key, rail) if self._wrap is not None else transport

    def _on_slice_failure(self, task: SliceTask, error: TransportError) -> None:
        """Called on a rail thread: retry the slice on the next rail, or fail its request."""
        piece, attempt = task.slice, task.attempt + 1
        if not error.retryable or attempt > self.config.max_retries or self._closing:
            tries = f"after {attempt} attempts" if error.retryable else "(not retryable)"
            task.batch.slice_failed(piece.request_index, f"slice [{piece.remote_offset}, "
                                                 f"+{piece.length}) failed {tries}: {error}")
            return
        rail = retry_rail(task.request.preference, piece.rail, attempt)
        self._rails[rail].submit(SliceTask(task.batch, task.request, piece, attempt))
