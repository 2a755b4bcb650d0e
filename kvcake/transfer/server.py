"""Segment server: serves reads and writes of this engine's registered segments over TCP.

One thread accepts; one thread per connection runs request -> reply in order (a client may
send several requests before reading the replies: they wait in the socket buffer). Every header field
is checked against the segment table before any byte moves: a bad request gets an error reply and
the connection keeps serving; a frame that cannot be parsed gets an error reply and that one
connection is closed (its byte stream can no longer be trusted). Other connections never notice.
With a cluster secret, a connection must pass the challenge of `kvcake.auth` before its first
request is read; one that fails is logged and closed, having touched nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping

import msgpack

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.transfer import checksum, frame
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.frame import FrameError, Header, Op, Status
from kvcake.transfer.segment import Segment
from kvcake.transfer.tcp import (
    recv_digested,
    recv_exactly,
    send_digested,
    send_message,
    tune_socket,
)

log = logging.getLogger(__name__)
_DRAIN_CHUNK = 1 << 20
_MAX_DRAIN_BYTES = 1 << 30  # a rejected write longer than this closes the connection instead


class SegmentServer:
    """Serves `segments` (a live mapping segment_id -> Segment, owned by the engine) to peers
    that prove `secret` (None: to anyone who connects)."""

    def __init__(self, segments: Mapping[int, Segment], *, host: str, port: int, port_search: int,
                 buffer_bytes: int, secret: ClusterSecret | None = None) -> None:
        self._segments = segments
        self._secret = secret
        self._host, self._port, self._port_search = host, port, port_search
        self._buffer_bytes = buffer_bytes
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False
        self.address = ""

    def start(self) -> None:
        self._listener = self._bind()
        host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        thread = threading.Thread(target=self._accept_loop, name=f"kvcake-seg-{port}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        if self._listener is not None:
            _shutdown(self._listener)
            self._listener.close()
        for conn in conns:
            _shutdown(conn)
        for thread in list(self._threads):
            thread.join(timeout=5.0)

    def _bind(self) -> socket.socket:
        last_error: OSError | None = None
        ports = [0] if self._port == 0 else range(self._port, self._port + self._port_search)
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self._host, port))
                sock.listen(128)
                return sock
            except OSError as e:
                sock.close()
                last_error = e
        raise OSError(f"no free port for the segment server on {self._host} in "
                      f"{self._port}..{self._port + self._port_search - 1}: {last_error}")

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._conns.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name="kvcake-seg-conn")
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        tune_socket(conn, self._buffer_bytes)
        header = bytearray(frame.HEADER_BYTES)
        try:
            if not auth.admit(conn, self._secret, auth.SEGMENT, log):
                return
            while self._serve_one(conn, memoryview(header)):
                pass
        except OSError:
            pass  # the peer went away or we are closing
        except Exception:  # a bug here must not take the server down: log it, drop this link
            log.exception("segment server connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket, header: memoryview) -> bool:
        """Serve one request; False when the connection should end."""
        try:
            recv_exactly(conn, header)
        except ConnectionError:
            return False
        try:
            request = frame.unpack(header)
        except FrameError as e:
            _reply(conn, *frame.error_reply(None, e.status, str(e)))
            return False
        try:
            return self._dispatch(conn, request)
        except FrameError as e:
            if request.op == Op.WRITE and e.status is not Status.CHECKSUM_MISMATCH:
                if request.length > _MAX_DRAIN_BYTES:
                    _reply(conn, *frame.error_reply(request, e.status, str(e)))
                    return False
                _drain(conn, request.length + (frame.TRAILER_BYTES if request.flags else 0))
            _reply(conn, *frame.error_reply(request, e.status, str(e)))
            return e.status is not Status.BAD_FRAME

    def _dispatch(self, conn: socket.socket, request: Header) -> bool:
        if request.op == Op.PING:
            _reply(conn, Header(op=request.op | frame.REPLY, request_id=request.request_id), b"")
        elif request.op == Op.LOOKUP:
            self._lookup(conn, request)
        elif request.op in (Op.READ, Op.WRITE):
            segment = self._segments.get(request.segment_id)
            if segment is None:
                raise FrameError(f"unknown segment id {request.segment_id}",
                                 Status.UNKNOWN_SEGMENT)
            frame.check_range(request.offset, request.length, segment.length_bytes)
            view = segment.view[request.offset:request.offset + request.length]
            kind = request.checksum_kind
            if kind is not None and kind not in checksum.available():
                raise FrameError(f"checksum {kind.name} is not available on this server",
                                 Status.BAD_CHECKSUM_KIND)
            if request.op == Op.READ:
                reply = Header(op=Op.READ | frame.REPLY, request_id=request.request_id,
                               length=len(view), flags=request.flags)
                if kind is None:
                    _reply(conn, reply, view)
                else:
                    send_digested(conn, reply.pack(), view, kind)
            else:
                self._receive_write(conn, view, kind)
                _reply(conn, Header(op=Op.WRITE | frame.REPLY, request_id=request.request_id), b"")
        else:  # a reply op sent as a request
            _reply(conn, *frame.error_reply(request, Status.BAD_FRAME, f"op {request.op} is a reply"))
            return False
        return True

    @staticmethod
    def _receive_write(conn: socket.socket, view: memoryview, kind: ChecksumKind | None) -> None:
        """Store a write's bytes; with a checksum, check them against the trailer.

        A mismatch leaves the range undefined (the bytes already landed) and is reported so the
        writer retries; the stream is still in step, so the connection keeps serving."""
        if kind is None:
            recv_exactly(conn, view)
            return
        local, remote = recv_digested(conn, view, kind)
        if local != remote:
            raise FrameError("checksum mismatch on written data", Status.CHECKSUM_MISMATCH)

    def _lookup(self, conn: socket.socket, request: Header) -> None:
        if not 0 < request.length <= frame.MAX_NAME_BYTES:
            raise FrameError(f"segment name length {request.length} not in 1..{frame.MAX_NAME_BYTES}")
        name_bytes = bytearray(request.length)
        recv_exactly(conn, memoryview(name_bytes))
        name = name_bytes.decode("utf-8", "replace")
        for segment in list(self._segments.values()):
            if segment.name == name:
                body = msgpack.packb(segment.desc(self.address).to_dict())
                _reply(conn, Header(op=Op.LOOKUP | frame.REPLY, request_id=request.request_id,
                                    length=len(body)), body)
                return
        _reply(conn, *frame.error_reply(request, Status.UNKNOWN_SEGMENT,
                                        f"no segment named {name!r}"))


def _reply(conn: socket.socket, header: Header, body: bytes | memoryview) -> None:
    send_message(conn, header.pack(), body)


def _drain(conn: socket.socket, length: int) -> None:
    scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK)))
    while length > 0:
        chunk = scratch[:min(length, len(scratch))]
        recv_exactly(conn, chunk)
        length -= len(chunk)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
