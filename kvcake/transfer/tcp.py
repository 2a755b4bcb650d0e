"""TCP endpoint: one connection from one rail to one peer's segment server.

Reads land straight in the destination buffer (`recv_into` on a memoryview: no intermediate copy);
writes go out straight from the source buffer (`sendall` on a memoryview).
"""

from __future__ import annotations

import itertools
import socket
import struct

import msgpack

from kvcake.transfer import frame
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.errors import TransportError
from kvcake.transfer.frame import Header, Op, Status
from kvcake.transfer.segment import SegmentDesc


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host, int(port)


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """Large kernel buffers (fewer wake-ups per slice) and no Nagle delay on the small headers."""
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
    sent = sock.sendmsg([header, body])
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(body):
        sock.sendall(memoryview(body)[sent - len(header):])


class TcpTransport:
    """A `Transport` over one TCP connection. Create with `connect`; not thread-safe by design."""

    def __init__(self, sock: socket.socket, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._sock = sock
        self._header = bytearray(frame.HEADER_BYTES)
        self._request_ids = itertools.count(1)

    @classmethod
    def connect(cls, address: str, *, bind_host: str | None = None, timeout_s: float = 30.0,
                buffer_bytes: int = 8 << 20) -> TcpTransport:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection(
                (host, port), timeout=timeout_s,
                source_address=(bind_host, 0) if bind_host else None)
        except OSError as e:
            raise TransportError(f"cannot connect to {address}: {e}") from e
        tune_socket(sock, buffer_bytes)
        set_kernel_timeout(sock, timeout_s)
        return cls(sock, address, timeout_s)

    @property
    def local_address(self) -> str:
        """"host:port" this end is bound to (the rail's NIC when `bind_host` was given)."""
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def read(self, segment: SegmentDesc, offset: int, dest: memoryview, *,
             checksum: ChecksumKind | None) -> int | None:
        request = Header(op=Op.READ, segment_id=segment.segment_id, offset=offset,
                         length=len(dest), request_id=next(self._request_ids),
                         flags=int(checksum or 0))
        reply = self._call(request, None)
        if reply.length != len(dest):
            self.close()
            raise TransportError(f"{self.address}: reply carries {reply.length} bytes, "
                                 f"asked for {len(dest)}")
        self._recv(dest)
        return reply.checksum if checksum else None

    def write(self, segment: SegmentDesc, offset: int, src: memoryview, *,
              checksum: ChecksumKind | None, digest: int | None) -> None:
        with_digest = checksum is not None and digest is not None
        request = Header(op=Op.WRITE, segment_id=segment.segment_id, offset=offset,
                         length=len(src), request_id=next(self._request_ids),
                         checksum=digest if with_digest and digest else 0,
                         flags=int(checksum) if with_digest and checksum else 0)
        self._call(request, src)

    def lookup(self, name: str) -> SegmentDesc:
        """Ask the server for the descriptor of its segment `name` (TransportError if unknown)."""
        body = name.encode("utf-8")
        request = Header(op=Op.LOOKUP, length=len(body), request_id=next(self._request_ids))
        reply = self._call(request, memoryview(body))
        payload = bytearray(reply.length)
        self._recv(memoryview(payload))
        return SegmentDesc.from_dict(msgpack.unpackb(bytes(payload)))

    def ping(self) -> None:
        self._call(Header(op=Op.PING, request_id=next(self._request_ids)), None)

    def close(self) -> None:
        self._sock.close()

    def _call(self, request: Header, payload: memoryview | None) -> Header:
        """Send one request (and its payload); return the OK reply header or raise."""
        try:
            send_message(self._sock, request.pack(), payload)
            recv_exactly(self._sock, memoryview(self._header))
            reply = frame.unpack(self._header)
        except (OSError, frame.FrameError) as e:
            self.close()
            raise TransportError(f"{self.address}: {_describe(e, self.timeout_s)}") from e
        if reply.request_id != request.request_id or reply.op != request.op | frame.REPLY:
            self.close()
            raise TransportError(f"{self.address}: reply does not match request "
                                 f"{request.request_id} (got {reply.request_id})")
        if reply.status != Status.OK:
            raise self._remote_error(reply)
        return reply

    def _recv(self, dest: memoryview) -> None:
        try:
            recv_exactly(self._sock, dest)
        except OSError as e:
            self.close()
            raise TransportError(f"{self.address}: {_describe(e, self.timeout_s)}") from e

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
