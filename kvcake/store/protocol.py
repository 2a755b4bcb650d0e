"""Control-plane wire format: msgpack maps in length-prefixed frames over TCP.

    frame   = u32 big-endian body length | msgpack body
    request = {"id": int, "op": str, "args": {name: value}}
    reply   = {"id": int, "ok": true, "result": value}
            | {"id": int, "ok": false, "error": {"type": wire name, "message": str}}

Every request is checked against `SCHEMA` before it reaches the master; a malformed frame gets an
error reply (or, if it cannot even be framed, a closed connection) and the server keeps serving.
With a cluster secret, the connection opens with the challenge of `kvcake.auth` (STORE_RPC).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.store.errors import WIRE_ERRORS, InvalidRequest, MasterUnavailable, StoreError
from kvcake.store.frames import LENGTH_PREFIX
from kvcake.store.frames import MAX_FRAME_BYTES as MAX_FRAME_BYTES  # re-exported: the framing
from kvcake.store.frames import FrameReader as FrameReader
from kvcake.store.frames import read_frame as read_frame
from kvcake.store.payload import PAYLOAD_OPS

T = TypeVar("T")

_STR, _INT, _BOOL, _DICT, _LIST = str, int, bool, dict, list
# op -> {arg: (type, required)}
SCHEMA: dict[str, dict[str, tuple[type, bool]]] = {
    "register_node": {"node_id": (_STR, True), "dram_bytes": (_INT, True),
                      "disk_bytes": (_INT, True), "endpoint": (_DICT, True),
                      "control_address": (_STR, False), "objects": (_LIST, False)},
    "heartbeat": {"node_id": (_STR, True), "stats": (_DICT, False)},
    "unregister_node": {"node_id": (_STR, True)},
    "put_start": {"key": (_STR, True), "size_bytes": (_INT, True), "checksum": (_INT, False),
                  "num_replicas": (_INT, False), "local_node": (_STR, False)},
    "put_commit": {"key": (_STR, True), "checksum": (_INT, False)},
    "put_revoke": {"key": (_STR, True)},
    "put_start_batch": {"items": (_LIST, True), "num_replicas": (_INT, False),
                        "local_node": (_STR, False)},
    "put_commit_batch": {"keys": (_LIST, True)},
    "put_slots": {"commits": (_LIST, True), "reserve": (_LIST, False),
                  "seal_later": (_BOOL, False)},
    "put_seal": {"keys": (_LIST, True)},
    # a master hosting a node (hosted.py): the whole put in one request; the payload's
    # `size_bytes` raw bytes follow the frame (PAYLOAD_OPS)
    "put_inline": {"key": (_STR, True), "size_bytes": (_INT, True), "checksum": (_INT, True),
                   "num_replicas": (_INT, False), "local_node": (_STR, False)},
    # client -> a node's forward port (forward.py): bytes into a slot, verified, then the node
    # commits the slot at the master; `size_bytes` raw bytes follow the frame (PAYLOAD_OPS)
    "put_forward": {"key": (_STR, True), "slot": (_INT, True), "offset": (_INT, True),
                    "version": (_INT, True), "size_bytes": (_INT, True),
                    "checksum": (_INT, True), "reserve": (_LIST, False)},
    "release_slots": {"slots": (_LIST, True)},
    "touch": {"keys": (_LIST, True)},
    "get": {"key": (_STR, True)},
    "release_leases": {"leases": (_LIST, True)},
    "get_batch": {"keys": (_LIST, True)},
    "exists": {"key": (_STR, True)},
    "exists_batch": {"keys": (_LIST, True)},
    "remove": {"key": (_STR, True)},
    "remove_batch": {"keys": (_LIST, True)},
    "pin": {"key": (_STR, True), "pinned": (_BOOL, True)},
    "add_replicas": {"key": (_STR, True), "num_replicas": (_INT, True)},
    "replicas_done": {"key": (_STR, True), "versions": (_LIST, True), "ok": (_BOOL, True)},
    "drop_replicas": {"key": (_STR, True), "num_replicas": (_INT, True)},
    "stats": {},
    # master -> node (a node's control server)
    "demote": {"key": (_STR, True), "offset": (_INT, True), "alloc_bytes": (_INT, True),
               "version": (_INT, True), "disk_version": (_INT, True)},
    "promote": {"key": (_STR, True), "offset": (_INT, True), "alloc_bytes": (_INT, True),
                "version": (_INT, True), "disk_version": (_INT, True)},
    "drop_disk": {"key": (_STR, True), "disk_version": (_INT, True)},
    # master -> node: mark dropped replicas [[offset, version], ...] revoked (layout.revoke)
    "revoke": {"entries": (_LIST, True)},
    # master -> node, one-way, with failover on: the node's catalogue of its committed objects
    # ([key, offset, alloc_bytes, version, size_bytes, checksum] / [key, version]), which it
    # re-registers with a new master (rebuild.py)
    "hold": {"objects": (_LIST, True)},
    "forget": {"objects": (_LIST, True)},
}


_FIELDS = {op: frozenset(spec) for op, spec in SCHEMA.items()}  # each op's argument names

# Ops the server never answers: the client sends them and goes on (see RpcConnection.send).
ONE_WAY_OPS = frozenset({"release_leases", "release_slots", "touch", "put_seal", "hold",
                         "forget"})
_MAX_DEFERRED = 64  # deferred one-way frames (RpcConnection.defer) held before they are sent
_MAX_MERGED = 1024  # items merged into one deferred frame (RpcConnection.defer_items) at most


def validate(message: object) -> tuple[int, str, dict[str, Any]]:
    """(id, op, args) of a well-formed request; InvalidRequest naming what is wrong otherwise."""
    if not isinstance(message, dict):
        raise InvalidRequest("frame: a request must be a msgpack map")
    req_id, op, args = message.get("id"), message.get("op"), message.get("args", {})
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise InvalidRequest("id: a request needs an integer id")
    if not isinstance(op, str) or op not in SCHEMA:
        raise InvalidRequest(f"op: unknown operation {op!r}")
    if not isinstance(args, dict):
        raise InvalidRequest(f"args: must be a map for op {op!r}")
    spec = SCHEMA[op]
    extra = args.keys() - _FIELDS[op]
    if extra:
        unknown = sorted(extra, key=str)
        raise InvalidRequest(f"args: unknown fields {unknown} for op {op!r}")
    for name, (kind, required) in spec.items():
        if name not in args or args[name] is None:
            if required:
                raise InvalidRequest(f"{name}: required by op {op!r}")
            continue
        value = args[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidRequest(f"{name}: must be {kind.__name__} for op {op!r}, got "
                                 f"{type(value).__name__}")
    return req_id, op, args


def encode(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


def error_reply(req_id: int, exc: BaseException) -> dict[str, Any]:
    name = type(exc).__name__ if type(exc).__name__ in WIRE_ERRORS else "StoreError"
    return {"id": req_id, "ok": False, "error": {"type": name, "message": str(exc)}}


def parse_address(address: str, field: str = "address") -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: expected HOST:PORT, got {address!r}")
    return host, int(port)


class RpcConnection:
    """A blocking request/reply connection; thread-safe (one call at a time). With `secret`,
    it proves the cluster secret at connect (MasterUnavailable naming why if that fails)."""

    def __init__(self, address: str, timeout_s: float = 30.0,
                 secret: ClusterSecret | None = None) -> None:
        self.address = address
        host, port = parse_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise MasterUnavailable(f"cannot connect to {address}: {exc}") from None
        try:
            auth.authenticate(self._sock, secret, auth.STORE_RPC,
                              min(timeout_s, auth.HANDSHAKE_TIMEOUT_S))
        except OSError as exc:
            self._sock.close()
            raise MasterUnavailable(f"{address}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking socket, timeout kept by the kernel: Python's timeout mode polls before every
        # send and recv (two more system calls per call; see transfer.tcp.set_kernel_timeout).
        self._sock.settimeout(None)
        timeval = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._reader = FrameReader(self._sock)
        self._lock = threading.Lock()
        self._next_id = 0
        self._deferred: list[bytes] = []  # one-way frames that go out with the next send
        self._merged: dict[tuple[str, str], list[Any]] = {}  # (op, field) -> items (defer_items)

    def defer(self, op: str, **args: Any) -> None:
        """A one-way request (an op in ONE_WAY_OPS) sent with this connection's next request,
        in the same system call: no round trip, no send of its own, no wake-up of the other side
        of its own. It is handled before that next request (or sent by `flush`/`close`)."""
        if op not in ONE_WAY_OPS:
            raise ValueError(f"op: {op!r} is answered; use call()")
        with self._lock:
            self._next_id += 1
            self._deferred.append(encode({"id": self._next_id, "op": op, "args": args}))
            if len(self._deferred) < _MAX_DEFERRED:
                return
            self._sendall(b"")

    def defer_items(self, op: str, field: str, items: list[Any]) -> None:
        """`defer(op, field=items)`, merged with the items deferred for that op before: one
        frame for them all, sent with the next request (or once `_MAX_MERGED` are waiting)."""
        if op not in ONE_WAY_OPS:
            raise ValueError(f"op: {op!r} is answered; use call()")
        with self._lock:
            pending = self._merged.setdefault((op, field), [])
            pending.extend(items)
            if len(pending) >= _MAX_MERGED:
                self._sendall(b"")

    def flush(self) -> None:
        """Send the deferred one-way requests now."""
        with self._lock:
            if self._deferred or self._merged:
                self._sendall(b"")

    def _sendall(self, frame: bytes, payload: memoryview | None = None) -> None:
        """Send the deferred frames, then `frame` (and `payload` right behind it, not copied),
        in one call (under the lock)."""
        if self._merged:
            for (op, field), items in self._merged.items():  # one-way: never answered, so
                self._deferred.append(encode({"id": 0, "op": op,  # no id of the call's own
                                              "args": {field: items}}))
            self._merged = {}
        if self._deferred:
            frame = b"".join(self._deferred) + frame
            self._deferred.clear()
        try:
            if payload is None or not len(payload):
                self._sock.sendall(frame)
                return
            parts = [memoryview(frame), payload]
            while parts:
                sent = self._sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts.pop(0))
                if parts:
                    parts[0] = parts[0][sent:]
        except OSError as exc:
            raise MasterUnavailable(f"{self.address}: {exc}") from None

    def call_with_payload(self, op: str, payload: memoryview, **args: Any) -> Any:
        """`call` of an op in PAYLOAD_OPS, `payload`'s bytes sent right behind its frame."""
        field = PAYLOAD_OPS.get(op)
        if field is None:
            raise ValueError(f"op: {op!r} carries no payload; use call()")
        payload = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        args[field] = len(payload)
        with self._lock:
            self._next_id += 1
            self._sendall(encode({"id": self._next_id, "op": op, "args": args}), payload)
            reply = self._read_reply()
            req_id = self._next_id
        return self._result(reply, req_id)

    def send(self, op: str, **args: Any) -> None:
        """Send a one-way request (an op in ONE_WAY_OPS): no reply is read, so it costs one send
        and no round trip. It is handled before any later request on this connection."""
        if op not in ONE_WAY_OPS:
            raise ValueError(f"op: {op!r} is answered; use call()")
        with self._lock:
            self._next_id += 1
            self._sendall(encode({"id": self._next_id, "op": op, "args": args}))

    def call_overlapped(self, op: str, args: dict[str, Any], work: Callable[[], T]
                        ) -> tuple[Any, T]:
        """`call(op, **args)`, running `work()` on this thread while the other side handles
        the request; returns (result, work's result). The reply is read even if `work` raises
        (then its exception propagates), so the connection stays in step."""
        with self._lock:
            self._next_id += 1
            self._sendall(encode({"id": self._next_id, "op": op, "args": args}))
            try:
                value = work()
            finally:
                reply = self._read_reply()
            req_id = self._next_id
        return self._result(reply, req_id), value

    def call(self, op: str, **args: Any) -> Any:
        with self._lock:
            self._next_id += 1
            self._sendall(encode({"id": self._next_id, "op": op, "args": args}))
            reply = self._read_reply()
            req_id = self._next_id
        return self._result(reply, req_id)

    def _read_reply(self) -> object:
        """The next reply on this connection; a broken connection is MasterUnavailable."""
        try:
            return self._reader.read()
        except OSError as exc:
            raise MasterUnavailable(f"{self.address}: {exc}") from None

    def _result(self, reply: object, req_id: int) -> Any:
        if not isinstance(reply, dict) or reply.get("id") != req_id:
            raise MasterUnavailable(f"{self.address}: connection closed or out of sync")
        if reply.get("ok"):
            return reply.get("result")
        error = reply.get("error") or {}
        cls = WIRE_ERRORS.get(str(error.get("type")), StoreError)
        raise cls(str(error.get("message", "")))

    def close(self) -> None:
        try:
            self.flush()
        except MasterUnavailable:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
