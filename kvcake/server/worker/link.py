"""`MessageLink`: one TCP connection carrying control messages (`messages.py`) both ways, in
the store's length-prefixed frames; a bad frame raises `MessageError`."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.server.worker.messages import Message, MessageError, from_wire, to_wire
from kvcake.store.errors import InvalidRequest
from kvcake.store.protocol import FrameReader, encode


class MessageLink:
    """One TCP connection carrying messages both ways. `send` is thread-safe; `recv` is for one
    reader thread. `close()` is idempotent and wakes a blocked `recv` (it returns None)."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._reader = FrameReader(sock)  # one reader thread per link, as FrameReader needs
        self._send_lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, address: str, timeout_s: float = 10.0,
                secret: ClusterSecret | None = None) -> MessageLink:
        """Connect to a worker's control port, proving `secret` first (`kvcake.auth`; None: the
        worker must run without one). `auth.AuthError` when either side fails the challenge."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address: expected HOST:PORT, got {address!r}")
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            auth.authenticate(sock, secret, auth.WORKER, min(timeout_s, auth.HANDSHAKE_TIMEOUT_S))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return cls(sock)

    @property
    def closed(self) -> bool:
        return self._closed

    def set_send_timeout(self, timeout_s: float) -> None:
        """Fail a `send` (OSError) that cannot hand its bytes to the kernel within `timeout_s`:
        a peer that stops reading fills the socket buffer, and a send to it would otherwise
        block forever. Enforced by the kernel (SO_SNDTIMEO), so `recv` stays blocking. A send
        that fails this way may have sent part of its frame: the link must then be closed."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        seconds = int(timeout_s)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                              struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6)))

    def send(self, message: Message) -> None:
        """Send one message; OSError when the peer is gone (or, with a send timeout, stalled)."""
        frame = encode(to_wire(message))
        with self._send_lock:
            self._sock.sendall(frame)

    def send_many(self, messages: Sequence[Message]) -> None:
        """Send messages in order as one write: their frames back to back (the reader sees
        them one by one, as from `send`), one system call and one TCP segment instead of one
        each (a decode step's tokens for all its requests). OSError as `send`."""
        if not messages:
            return
        frames = b"".join(encode(to_wire(m)) for m in messages)
        with self._send_lock:
            self._sock.sendall(frames)

    def recv(self) -> Message | None:
        """The next message, or None at the end of the stream (peer closed, or close())."""
        try:
            body = self._reader.read()
        except InvalidRequest as exc:
            raise MessageError(str(exc)) from None
        except OSError:
            return None
        return None if body is None else from_wire(body)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
