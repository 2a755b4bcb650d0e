"""`DirectPath`: move one small batch on the caller's own thread, one request per transfer.

The transfer engine hands every slice to a rail thread and wakes the caller when the batch is
done: two thread hand-offs, ~0.1-0.5 ms each on a loaded host, which is most of the cost of a
1 MiB store operation. A store get or put of one object is one or two requests of at most a few
MiB, which the engine would put on one or two rails anyway, so the client moves such batches
itself, through the same transports (TCP to the owner's segment server, or the owner's shared
memory mapped here) and the same wire format, with one connection per peer per calling thread.
Requests to one node are pipelined on its connection (a header and its payload: one round trip).

Nothing is weakened: a request that fails here (path fault, peer gone, rejected range) makes
`transfer` return False and the caller hands the whole batch to the engine, which validates it,
retries slices on other rails and reports the error. Writes carry a digest exactly as the
engine would (`TransferConfig.digests`); the store's puts ask for one over TCP, and the
payload's digest is its object checksum, computed anyway. Reads carry none: every
store read is verified end to end (version and checksum of the payload, `layout.verify`), and a
read that fails that check is retried through the engine, with its checksums, before the replica
is given up (see `StoreClient._read_replicas`).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import cast

from kvcake.transfer import (
    EndpointKey,
    TransferConfig,
    TransferOp,
    TransferRequest,
    Transport,
    TransportError,
    TransportKind,
    TransportWrapper,
    buffer_view,
    local_host_id,
)
from kvcake.transfer import checksum as checksums
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.shm import ShmTransport
from kvcake.transfer.tcp import TcpTransport
from kvcake.transfer.transport import PipelinedTransport

# Operations in flight before their replies are read: bounded, so that what a batch sends
# before reading never outgrows the socket buffers of both ends.
_MAX_OUTSTANDING = 8


class DirectPath:
    """Per-thread endpoints to store nodes, for batches of at most `config.slice_bytes` bytes
    (larger ones are worth the engine's striping over rails). `wrap` is applied to every new
    endpoint, as `TransferEngine(wrap_transport=...)` does (tests inject faults with it).

    Each calling thread keeps one endpoint per node until `close()` (or until that endpoint
    fails): right for a few long-lived threads; many short-lived threads would each leave one
    connection open until then."""

    def __init__(self, config: TransferConfig, wrap: TransportWrapper | None = None) -> None:
        self.config = config
        self._wrap = wrap
        self._kind = checksums.parse(config.checksum, "TransferConfig.checksum")
        self._host_id = local_host_id()  # reads /proc each call: once is enough
        self._local = threading.local()
        # (shm_name, host_id, address) -> endpoint key: fixed by the config, so built once
        self._keys: dict[tuple[str | None, str, str], EndpointKey] = {}
        self._all: list[Transport] = []
        self._lock = threading.Lock()
        self._closed = False

    def accepts(self, requests: Sequence[TransferRequest]) -> bool:
        """True if this batch is small enough to move on the caller's thread."""
        total = 0
        for request in requests:
            total += len(request.buffer) if request.length is None else request.length
        return 0 < total <= self.config.slice_bytes and not self._closed

    def transfer(self, requests: Sequence[TransferRequest],
                 xxh3_digests: Sequence[int | None] = ()) -> bool:
        """Move every request on this thread; requests to one node are pipelined on its
        connection (all sent, then all replies read: one round trip). False as soon as one
        fails (every endpoint the batch used is then closed): the caller gives the batch to the
        engine. Never raises for a transport fault.

        `xxh3_digests[i]`, where the caller already knows it, is the xxh3-64 digest of write i's
        bytes: used as its transport digest when the transport checksum is xxh3, not computed
        again (the store's payload checksum is that same function)."""
        used: dict[EndpointKey, Transport] = {}
        waiting: list[PipelinedTransport] = []
        try:
            for i, request in enumerate(requests):
                if len(waiting) >= _MAX_OUTSTANDING:
                    _settle(waiting)
                known = xxh3_digests[i] if i < len(xxh3_digests) else None
                self._start(request, known, used, waiting)
            _settle(waiting)
        except (TransportError, ValueError, TypeError, RuntimeError):
            for key in used:
                self._drop(key)
            return False
        return True

    def close(self) -> None:
        """Close every endpoint of every thread. Idempotent; later batches are not accepted."""
        self._closed = True
        with self._lock:
            transports, self._all = self._all, []
        for transport in transports:
            transport.close()

    def _start(self, request: TransferRequest, known: int | None,
               used: dict[EndpointKey, Transport], waiting: list[PipelinedTransport]) -> None:
        """Send one request (pipelined transports: its completion is read later), or move it."""
        segment = request.segment
        route = (segment.shm_name, segment.host_id, segment.address)
        key = self._keys.get(route)
        if key is None:
            key = self._keys[route] = self._endpoint_key(*route)
        transport = used[key] = self._endpoint(key)
        view = buffer_view(request.buffer, writable=request.op is TransferOp.READ)
        if request.length is not None:
            view = view[:request.length]
        kind = None
        if request.op is TransferOp.WRITE and self.config.digests(key.kind is TransportKind.TCP,
                                                                  request.checksum_tcp):
            kind = self._kind
        digest = known if kind is ChecksumKind.XXH3_64 else None
        if getattr(transport, "pipelined", False):  # (isinstance on the Protocol: 30 us)
            transport = cast(PipelinedTransport, transport)
            if request.op is TransferOp.READ:
                transport.start_read(segment, request.remote_offset, view, checksum=None)
            else:  # with no digest given, the transport digests the bytes as it sends them
                transport.start_write(segment, request.remote_offset, view, checksum=kind,
                                      digest=digest)
            waiting.append(transport)
        elif request.op is TransferOp.READ:
            transport.read(segment, request.remote_offset, view, checksum=None)
        else:
            if kind is not None and digest is None:
                digest = kind.compute(view)
            transport.write(segment, request.remote_offset, view, checksum=kind, digest=digest)

    def _endpoint_key(self, shm_name: str | None, host_id: str, address: str) -> EndpointKey:
        if self.config.use_shared_memory and shm_name and host_id == self._host_id:
            return EndpointKey(TransportKind.SHM, shm_name)
        if not address:
            raise ValueError("segment has no server address")
        return EndpointKey(TransportKind.TCP, address)

    def _endpoint(self, key: EndpointKey) -> Transport:
        pool: dict[EndpointKey, Transport] | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = {}
        transport = pool.get(key)
        if transport is None:
            transport = self._connect(key)
            pool[key] = transport
            with self._lock:
                self._all.append(transport)
        return transport

    def _connect(self, key: EndpointKey) -> Transport:
        transport: Transport
        if key.kind is TransportKind.SHM:
            transport = ShmTransport.attach(key.peer)
        else:
            transport = TcpTransport.connect(key.peer, timeout_s=self.config.io_timeout_s,
                                             buffer_bytes=self.config.socket_buffer_bytes,
                                             secret=self.config.secret)
        return self._wrap(transport, key, 0) if self._wrap is not None else transport

    def _drop(self, key: EndpointKey) -> None:
        pool: dict[EndpointKey, Transport] = self._local.pool
        transport = pool.pop(key, None)
        if transport is None:
            return
        with self._lock:
            if transport in self._all:
                self._all.remove(transport)
        transport.close()


def _settle(waiting: list[PipelinedTransport]) -> None:
    """Read one completion per started operation; raise the first operation's error."""
    while waiting:
        done = waiting.pop().next_completion()
        if done.error is not None:
            raise done.error
