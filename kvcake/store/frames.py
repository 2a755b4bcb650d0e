"""Framing of the control plane: length-prefixed msgpack bodies read from a socket.

    frame = u32 big-endian body length | msgpack body

`read_frame` reads one frame; `FrameReader` reads frames (and the raw payload bytes that may
follow one) with fewer system calls. An oversized or undecodable frame is an InvalidRequest: the
stream is then out of sync. The messages inside are `protocol.py`'s.
"""

from __future__ import annotations

import socket
import struct

import msgpack

from kvcake import auth
from kvcake.store.errors import InvalidRequest

MAX_FRAME_BYTES = 16 << 20
LENGTH_PREFIX = struct.Struct(">I")  # a frame's u32 big-endian body length


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes | None:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)


def read_frame(sock: socket.socket) -> object | None:
    """The decoded body of the next frame, or None at a clean end of stream. Raises
    InvalidRequest for an oversized or undecodable frame (the stream is then out of sync)."""
    head = _recv_exact(sock, LENGTH_PREFIX.size)
    if head is None:
        return None
    (length,) = LENGTH_PREFIX.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise InvalidRequest(f"frame: {length} bytes is over the {MAX_FRAME_BYTES} byte limit")
    body = _recv_exact(sock, length)
    if body is None:
        return None
    return _decode(body)


def _decode(body: bytes | bytearray | memoryview) -> object:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise InvalidRequest(f"frame: not valid msgpack ({exc})") from None


class FrameReader:
    """`read_frame` for one socket with fewer system calls: what one recv brings (usually a
    whole small frame, length prefix included; for a request with a payload, the frame and the
    payload's first bytes) is kept for the next frame or payload. One reader per socket, used by
    one thread at a time.

    The unread rest of the last recv is kept as a view of it (`_rest`, not copied): frames are
    decoded from it and a payload is copied from it straight into its destination. Only a frame
    split over several recvs is gathered in `_buf`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._rest = memoryview(b"")  # the unread end of the last recv's chunk
        self._buf = bytearray()  # a frame that did not come whole in one chunk

    def read(self) -> object | None:
        """The decoded body of the next frame; None at the end of stream; InvalidRequest for
        an oversized or undecodable frame (the stream is then out of sync)."""
        if not self._rest:  # the usual case: nothing left over from the last recv
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                return None
            self._rest = memoryview(chunk)
        rest = self._rest
        if len(rest) >= LENGTH_PREFIX.size:
            (length,) = LENGTH_PREFIX.unpack_from(rest)
            end = LENGTH_PREFIX.size + length
            if len(rest) >= end and length <= MAX_FRAME_BYTES:  # whole: decoded in place
                self._rest = rest[end:]
                return _decode(rest[LENGTH_PREFIX.size:end])
        self._buf += rest  # a frame split over recvs: gathered in the buffer
        self._rest = memoryview(b"")
        return self._read_gathered()

    def _read_gathered(self) -> object | None:
        needed = LENGTH_PREFIX.size
        while True:
            if len(self._buf) >= LENGTH_PREFIX.size:
                (length,) = LENGTH_PREFIX.unpack_from(self._buf)
                if length > MAX_FRAME_BYTES and auth.is_hello(self._buf):
                    raise auth.AuthError("the server requires the cluster secret: configure "
                                         "the same secret on this side")
                if length > MAX_FRAME_BYTES:
                    raise InvalidRequest(f"frame: {length} bytes is over the {MAX_FRAME_BYTES} "
                                         "byte limit")
                needed = LENGTH_PREFIX.size + length
                if len(self._buf) >= needed:
                    body = bytes(self._buf[LENGTH_PREFIX.size:needed])
                    self._rest = memoryview(bytes(self._buf[needed:]))
                    self._buf.clear()
                    return _decode(body)
            chunk = self._sock.recv(max(1 << 16, needed - len(self._buf)))
            if not chunk:
                return None
            self._buf += chunk

    def read_exact_into(self, dest: memoryview) -> None:
        """The next len(dest) bytes of the stream (after the frames read) into `dest`: what the
        last recv brought first, then straight from the socket. OSError if the stream ends
        first."""
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        have = min(len(self._rest), len(dest))
        if have:
            dest[:have] = self._rest[:have]
            self._rest = self._rest[have:]
        got = have
        while got < len(dest):
            n = self._sock.recv_into(dest[got:])
            if n == 0:
                raise ConnectionError("the stream ended inside a payload")
            got += n

    def skip(self, num_bytes: int) -> None:
        """Discard the next `num_bytes` bytes of the stream."""
        scratch = memoryview(bytearray(min(num_bytes, 1 << 20)))
        while num_bytes:
            step = min(num_bytes, len(scratch))
            self.read_exact_into(scratch[:step])
            num_bytes -= step
