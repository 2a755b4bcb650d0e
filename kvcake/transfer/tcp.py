"""TCP endpoint: one connection from one rail to one peer's segment server, pipelined.

Reads land straight in the destination buffer (`recv_into` on a memoryview: no intermediate copy);
writes go out straight from the source buffer (`sendall` on a memoryview).
"""

from __future__ import annotations

import itertools
import socket
import struct
from dataclasses import dataclass
from typing import NoReturn

import msgpack

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.transfer import frame
from kvcake.transfer.checksum import ChecksumKind, Digest
from kvcake.transfer.errors import TransportError
from kvcake.transfer.frame import Header, Op, Status
from kvcake.transfer.segment import SegmentDesc
from kvcake.transfer.transport import Completion


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host, int(port)


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """Large kernel buffers (fewer wake-ups per slice) and no Nagle delay on the small headers."""
    if buffer_bytes:  # 0: leave the sizes to the kernel's autotuning
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def set_kernel_timeout(sock: socket.socket, timeout_s: float) -> None:
    """Blocking socket with the timeout enforced by the kernel (SO_RCVTIMEO / SO_SNDTIMEO).

    Python's own timeout mode makes the socket non-blocking and polls before every call: a 1 MiB
    send then goes out in many partial sends, each after a poll(), which doubled the sender's CPU
    per byte here. A blocking send of the whole slice is one syscall; a stalled peer still fails
    the call after `timeout_s` (with EAGAIN).
    """
    sock.settimeout(None)
    seconds = int(timeout_s)
    timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_exactly(sock: socket.socket, dest: memoryview) -> None:
    """Fill `dest` from the socket; ConnectionError if the peer closes first."""
    got, size = 0, len(dest)
    while got < size:
        n = sock.recv_into(dest[got:] if got else dest)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n


def send_message(sock: socket.socket, header: bytes, body: bytes | memoryview | None) -> None:
    """Send a header and its body with one `sendmsg` where the kernel takes it all (the usual
    case): one syscall and no copy of the body; the rest, if any, with `sendall`."""
    if body is None or len(body) == 0:
        sock.sendall(header)
        return
    send_buffers(sock, [header, body])


def send_buffers(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """Send the buffers in order: one `sendmsg`, then `sendall` of whatever it left."""
    sent = sock.sendmsg(buffers)
    for buffer in buffers:
        if sent >= len(buffer):
            sent -= len(buffer)
            continue
        sock.sendall(memoryview(buffer)[sent:])
        sent = 0


def send_digested(sock: socket.socket, header: bytes, body: memoryview, kind: ChecksumKind,
                  digest: int | None = None) -> None:
    """Send header, body and the body's digest trailer (frame.TRAILER).

    With `digest` given (the caller computed it), one `sendmsg`. Otherwise each chunk of the body
    (frame.CHUNK_BYTES) is digested just before the kernel copies it out, so the copy finds it in
    cache. 4 MiB chunks (a default slice; the 32 MiB L3 here holds it): 256 KiB chunks, meant to
    stay in L2, cost the server ~25% more CPU per GB here (more sends, more receiver wake-ups).
    """
    if digest is not None:
        send_buffers(sock, [header, body, frame.TRAILER.pack(digest)])
        return
    running = Digest(kind)
    first: list[bytes | memoryview] = [header]
    for offset in range(0, len(body), frame.CHUNK_BYTES):
        chunk = body[offset:offset + frame.CHUNK_BYTES]
        running.update(chunk)
        last = offset + frame.CHUNK_BYTES >= len(body)
        tail: list[bytes | memoryview] = [frame.TRAILER.pack(running.value())] if last else []
        send_buffers(sock, first + [chunk] + tail)
        first = []


def recv_digested(sock: socket.socket, dest: memoryview, kind: ChecksumKind) -> tuple[int, int]:
    """Fill `dest` and read the trailer that follows: (digest of what arrived, the sender's).

    Each chunk is digested right after it lands, while it is still in cache."""
    running = Digest(kind)
    for offset in range(0, len(dest), frame.CHUNK_BYTES):
        chunk = dest[offset:offset + frame.CHUNK_BYTES]
        recv_exactly(sock, chunk)
        running.update(chunk)
    trailer = bytearray(frame.TRAILER_BYTES)
    recv_exactly(sock, memoryview(trailer))
    return running.value(), frame.TRAILER.unpack(trailer)[0]


@dataclass(frozen=True)
class _Outstanding:
    op: Op
    dest: memoryview | None  # a read's destination
    checksum: ChecksumKind | None


class TcpTransport:
    """A `PipelinedTransport` over one TCP connection. Create with `connect`; not thread-safe by
    design (one rail thread owns it).

    Several requests may be outstanding: a read request is a header, a write request a header and
    its bytes, sent at once; replies are matched to requests by id, in whatever order they come.
    The segment server answers in order, so while the client checks one slice, the next ones are
    already on their way (the kernel buffers them): the connection never idles for a round trip.
    """

    def __init__(self, sock: socket.socket, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._sock = sock
        self._header = bytearray(frame.HEADER_BYTES)
        self._request_ids = itertools.count(1)
        self._outstanding: dict[int, _Outstanding] = {}
        self._closed = False

    @classmethod
    def connect(cls, address: str, *, bind_host: str | None = None, timeout_s: float = 30.0,
                buffer_bytes: int = 0, secret: ClusterSecret | None = None) -> TcpTransport:
        """Connect to the segment server at `address`, proving `secret` if given (the server
        must hold the same one; TransportError, not retryable, if either side fails it)."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection(
                (host, port), timeout=timeout_s,
                source_address=(bind_host, 0) if bind_host else None)
        except OSError as e:
            raise TransportError(f"cannot connect to {address}: {e}") from e
        try:
            auth.authenticate(sock, secret, auth.SEGMENT, min(timeout_s, auth.HANDSHAKE_TIMEOUT_S))
        except OSError as e:
            sock.close()
            raise TransportError(f"{address}: {e}", retryable=False) from e
        tune_socket(sock, buffer_bytes)
        set_kernel_timeout(sock, timeout_s)
        return cls(sock, address, timeout_s)

    @property
    def local_address(self) -> str:
        """"host:port" this end is bound to (the rail's NIC when `bind_host` was given)."""
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    @property
    def pipelined(self) -> bool:
        return True

    @property
    def num_outstanding(self) -> int:
        return len(self._outstanding)

    # -- one slice at a time ---------------------------------------------------------------------
    def read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
             checksum: ChecksumKind | None) -> int | None:
        self._require_idle()
        return self._settle(self.start_read(segment, offset, dest, checksum=checksum)).digest

    def write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
              checksum: ChecksumKind | None, digest: int | None) -> None:
        self._require_idle()
        self._settle(self.start_write(segment, offset, src, checksum=checksum, digest=digest))

    # -- pipelined -------------------------------------------------------------------------------
    def start_read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
                   checksum: ChecksumKind | None) -> int:
        request = Header(op=Op.READ, segment_id=segment.segment_id, offset=offset,
                         length=len(dest), request_id=next(self._request_ids),
                         flags=int(checksum or 0))
        return self._start(request, None, _Outstanding(Op.READ, dest, checksum))

    def start_write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
                    checksum: ChecksumKind | None, digest: int | None) -> int:
        request = Header(op=Op.WRITE, segment_id=segment.segment_id, offset=offset,
                         length=len(src), request_id=next(self._request_ids),
                         flags=int(checksum or 0))
        return self._start(request, src, _Outstanding(Op.WRITE, None, checksum), digest)

    def next_completion(self) -> Completion:
        if self._closed:
            raise TransportError(f"{self.address}: connection is closed")
        if not self._outstanding:
            raise RuntimeError(f"{self.address}: no operation is outstanding")
        reply = self._recv_header()
        pending = self._outstanding.pop(reply.request_id, None)
        if pending is None or reply.op != pending.op | frame.REPLY:
            self._fail(f"reply {reply.request_id} (op {reply.op}) matches no outstanding request")
        assert pending is not None
        if reply.status != Status.OK:
            return Completion(reply.request_id, error=self._remote_error(reply))
        if pending.dest is not None:
            if reply.length != len(pending.dest):
                self._fail(f"reply carries {reply.length} bytes, asked for {len(pending.dest)}")
            if pending.checksum is None:
                self._recv(pending.dest)
                return Completion(reply.request_id)
            return self._recv_checked(reply.request_id, pending.dest, pending.checksum)
        return Completion(reply.request_id)

    # -- control ---------------------------------------------------------------------------------
    def lookup(self, name: str) -> SegmentDesc:
        """Ask the server for the descriptor of its segment `name` (TransportError if unknown)."""
        self._require_idle()
        body = name.encode("utf-8")
        request = Header(op=Op.LOOKUP, length=len(body), request_id=next(self._request_ids))
        reply = self._call(request, memoryview(body))
        payload = bytearray(reply.length)
        self._recv(memoryview(payload))
        return SegmentDesc.from_dict(msgpack.unpackb(bytes(payload)))

    def ping(self) -> None:
        self._require_idle()
        self._call(Header(op=Op.PING, request_id=next(self._request_ids)), None)

    def close(self) -> None:
        self._closed = True
        self._outstanding.clear()
        self._sock.close()

    # -- internals -------------------------------------------------------------------------------
    def _start(self, request: Header, payload: memoryview | None, pending: _Outstanding,
               digest: int | None = None) -> int:
        if self._closed:
            raise TransportError(f"{self.address}: connection is closed")
        try:
            if payload is not None and pending.checksum is not None:
                send_digested(self._sock, request.pack(), payload, pending.checksum, digest)
            else:
                send_message(self._sock, request.pack(), payload)
        except OSError as e:
            self.close()
            raise TransportError(f"{self.address}: {_describe(e, self.timeout_s)}") from e
        self._outstanding[request.request_id] = pending
        return request.request_id

    def _settle(self, token: int) -> Completion:
        done = self.next_completion()
        if done.token != token:  # cannot happen with one request outstanding
            self._fail(f"reply {done.token} does not match request {token}")
        if done.error is not None:
            raise done.error
        return done

    def _call(self, request: Header, payload: memoryview | None) -> Header:
        """Send one control request (and its payload); return the OK reply header or raise."""
        self._start(request, payload, _Outstanding(Op(request.op), None, None))
        reply = self._recv_header()
        self._outstanding.pop(request.request_id, None)
        if reply.request_id != request.request_id or reply.op != request.op | frame.REPLY:
            self._fail(f"reply does not match request {request.request_id} "
                       f"(got {reply.request_id})")
        if reply.status != Status.OK:
            raise self._remote_error(reply)
        return reply

    def _recv_header(self) -> Header:
        try:
            recv_exactly(self._sock, memoryview(self._header))
            return frame.unpack(self._header)
        except frame.FrameError as e:
            self.close()
            if auth.is_hello(self._header):
                raise TransportError(f"{self.address}: the segment server requires the cluster "
                                     "secret: configure it on this side (TransferConfig.secret)",
                                     retryable=False) from e
            raise TransportError(f"{self.address}: {e}") from e
        except OSError as e:
            self.close()
            raise TransportError(f"{self.address}: {_describe(e, self.timeout_s)}") from e

    def _recv_checked(self, token: int, dest: memoryview, kind: ChecksumKind) -> Completion:
        """Receive a read's bytes and trailer, digesting as they land. A mismatch fails this read
        alone (the stream is still in step): it is retried, and its bytes are never trusted."""
        try:
            local, remote = recv_digested(self._sock, dest, kind)
        except OSError as e:
            self.close()
            raise TransportError(f"{self.address}: {_describe(e, self.timeout_s)}") from e
        if local != remote:
            return Completion(token, remote, TransportError(
                f"{self.address}: checksum mismatch on read {token} ({len(dest)} bytes)"))
        return Completion(token, remote, verified=True)

    def _recv(self, dest: memoryview) -> None:
        try:
            recv_exactly(self._sock, dest)
        except OSError as e:
            self.close()
            raise TransportError(f"{self.address}: {_describe(e, self.timeout_s)}") from e

    def _fail(self, message: str) -> NoReturn:
        """The byte stream can no longer be trusted: close, and lose what is outstanding."""
        self.close()
        raise TransportError(f"{self.address}: {message}")

    def _require_idle(self) -> None:
        if self._outstanding:
            raise RuntimeError(f"{self.address}: {len(self._outstanding)} pipelined operations "
                               f"are outstanding; take their completions first")

    def _remote_error(self, reply: Header) -> TransportError:
        body = bytearray(min(reply.length, frame.MAX_ERROR_BYTES))
        self._recv(memoryview(body))
        status = Status(reply.status) if reply.status in Status._value2member_map_ else None
        if status is None or status is Status.BAD_FRAME:
            self.close()  # the server drops the stream after a bad frame
        name = status.name if status else f"status {reply.status}"
        return TransportError(f"{self.address}: {name}: {body.decode('utf-8', 'replace')}",
                              retryable=status in frame.RETRYABLE)


def _describe(error: Exception, timeout_s: float) -> str:
    if isinstance(error, BlockingIOError):  # what a kernel-side timeout raises
        return f"timed out after {timeout_s} s"
    return str(error)
