"""A small threaded server for control frames (see protocol.py): one thread per connection.

A request of an op in `PAYLOAD_OPS` is followed by raw bytes: the handler gets them as
`args["payload"]` (a `Payload` it reads into their destination), and what it leaves is skipped.

Used by the master and by each node's control endpoint. The handler gets (op, args, session);
`session` is a dict private to the connection, so the master can remember which node a connection
belongs to and drop that node's replicas when the connection closes. With a cluster secret, a
connection must pass the challenge of `kvcake.auth` (STORE_RPC) before its first frame is read;
one that fails is logged and closed, and no handler ever sees it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.store.errors import InvalidRequest
from kvcake.store.payload import Payload, payload_size
from kvcake.store.protocol import ONE_WAY_OPS, FrameReader, encode, error_reply, validate

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any], dict[str, Any]], Any]
OnClose = Callable[[dict[str, Any]], None]


class RpcServer:
    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 on_close: OnClose | None = None, secret: ClusterSecret | None = None) -> None:
        self._handler = handler
        self._secret = secret
        self._on_close = on_close
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("server not started: call start() first")
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> RpcServer:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self._host, self._port))
        except OSError as exc:
            listener.close()
            raise ValueError(f"port: cannot listen on {self._host}:{self._port} ({exc})") from None
        listener.listen(128)
        self._listener = listener
        self._spawn(self._accept_loop, "rpc-accept")
        return self

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, "rpc-conn", conn)

    def _serve(self, conn: socket.socket) -> None:
        session: dict[str, Any] = {}
        reader = FrameReader(conn)
        try:
            if not auth.admit(conn, self._secret, auth.STORE_RPC, log):
                return
            while not self._closed:
                try:
                    message = reader.read()
                    size = payload_size(message)
                except InvalidRequest as exc:  # cannot resync a broken stream: reply, then close
                    conn.sendall(encode(error_reply(0, exc)))
                    return
                if message is None:
                    return
                payload = Payload(reader, size) if size is not None else None
                reply = self._dispatch(message, session, payload)
                if payload is not None:
                    payload.skip()  # what the handler did not read (e.g. it refused the op)
                if isinstance(message, dict) and message.get("op") in ONE_WAY_OPS:
                    if not reply["ok"]:  # nobody waits for this reply: log it instead
                        log.warning("one-way %s failed: %s", message["op"], reply["error"])
                    continue
                conn.sendall(encode(reply))
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if self._on_close is not None:
                self._on_close(session)

    def _dispatch(self, message: object, session: dict[str, Any],
                  payload: Payload | None = None) -> dict[str, Any]:
        req_id = message.get("id", 0) if isinstance(message, dict) else 0
        req_id = req_id if isinstance(req_id, int) else 0
        try:
            req_id, op, args = validate(message)
            if payload is not None:  # a payload op's raw bytes (protocol.PAYLOAD_OPS)
                args = {**args, "payload": payload}
            return {"id": req_id, "ok": True, "result": self._handler(op, args, session)}
        except Exception as exc:  # every error becomes a reply; the server keeps serving
            if not isinstance(exc, (KeyError, ValueError)) and type(exc).__module__ != __package__ \
                    and not type(exc).__module__.startswith("kvcake.store"):
                log.exception("op failed")
            return error_reply(req_id, exc)
