"""Forwarded slot puts: the node that holds a slot commits it, so a small put to a separate node
is one client request.

Through a metadata-only master (`kvcake store master --no-node`) and a separate node, a slot put
(writer.py) is two client round trips: header + payload to the node's segment server, then
`put_slots` (commit + reserve the next slot) to the master. With forwarding, the client sends one
`put_forward` request to the node's forward port instead, the payload's raw bytes right behind
its frame (payload.PAYLOAD_OPS), and waits for the node's reply:

    client --put_forward + bytes--> node: bytes straight into the slot's payload range,
                                          xxh3-64 checked against the client's checksum
                                          (a mismatch: TransferFailed, nothing committed),
                                          header written
                                    node --put_slots [key, slot, size, checksum]--> master
                                    node <--commit ack + the next slot(s)---------- master
    client <--the master's reply----- node

The master's two-phase states are unchanged: the slot is a keyless allocation until the master
commits it, after the node stored and verified its bytes, and the client's `put` returns only
once the master's acknowledgement has come back through the node. A node that fails anywhere
in between leaves no object readable (its bytes are in a slot never committed, reclaimed after
`put_timeout_s`; or committed on a node the master drops as its connection closes) and the
client gets TransferFailed naming the node. The client forwards only puts that would cross TCP
to a node with a forward port (one replica, no shared memory, no async seal, no transport
wrapper, no master found through etcd), and only when `ClientConfig.forward_puts` is on (opt-in:
on this 2-core host it cut the client's CPU per 64 KiB put by half but was not faster end to end
under load; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvcake.auth import ClusterSecret
from kvcake.store.errors import InvalidRequest, MasterUnavailable, StoreError, TransferFailed
from kvcake.store.layout import HEADER_BYTES, pack_header, payload_checksum
from kvcake.store.payload import Payload
from kvcake.store.protocol import RpcConnection
from kvcake.store.remote import RemoteMaster
from kvcake.store.rpc_server import RpcServer

log = logging.getLogger(__name__)

FORWARD_OP = "put_forward"


class ForwardServer:
    """A node's forward port: serves `put_forward` into the segment `view()` returns, and
    commits through its own connection to `master_address` (one per client connection, opened
    on its first put, closed with it)."""

    def __init__(self, view: Callable[[], memoryview], master_address: str, *,
                 host: str = "127.0.0.1", secret: ClusterSecret | None = None) -> None:
        self._view = view
        self._master_address = master_address
        self._secret = secret
        self._server = RpcServer(self._handle, host, 0, on_close=self._on_close, secret=secret)

    @property
    def address(self) -> str:
        return self._server.address

    def start(self) -> ForwardServer:
        self._server.start()
        return self

    def close(self) -> None:
        self._server.close()

    def _handle(self, op: str, args: dict[str, Any], session: dict[str, Any]) -> Any:
        if op != FORWARD_OP:
            raise InvalidRequest(f"op: a node's forward port serves only {FORWARD_OP}, "
                                 f"not {op!r}")
        return self.put_forward(session, args)

    def put_forward(self, session: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        """Store the payload (`args["payload"]`) in the slot's range at `offset` (header of
        `version`), verified against `checksum`, then commit `slot` under `key` (and reserve
        per `reserve`) at the master: the master's `put_slots` answer. `args` as the wire
        schema says (protocol.py). TransferFailed if the bytes do not match (nothing is
        committed) or the master cannot be reached."""
        key, slot, offset, version = args["key"], args["slot"], args["offset"], args["version"]
        size_bytes, checksum, payload = args["size_bytes"], args["checksum"], args["payload"]
        assert isinstance(payload, Payload)
        view = self._view()
        start = offset + HEADER_BYTES
        if offset < 0 or start + size_bytes > len(view):
            raise InvalidRequest(f"offset: [{offset}, {start + size_bytes}) is not inside the "
                                 f"segment of {len(view)} bytes")
        window = view[start:start + size_bytes]
        payload.read_into(window)
        if payload_checksum(window) != checksum:
            raise TransferFailed(f"checksum: the payload of {key!r} does not match it "
                                 "(corrupted on the way, or computed over other bytes); "
                                 "nothing was committed")
        view[offset:start] = pack_header(checksum, version, size_bytes)
        master = session.get("master")
        try:
            if master is None:
                master = session["master"] = RemoteMaster(self._master_address,
                                                          secret=self._secret)
            return master.put_slots([[key, slot, size_bytes, checksum]], args.get("reserve"))
        except MasterUnavailable as exc:
            self._on_close(session)  # reconnect on the next put
            raise TransferFailed(f"put of {key!r}: stored and verified, but the commit did not "
                                 f"reach the master: {exc}") from None

    def _on_close(self, session: dict[str, Any]) -> None:
        master = session.pop("master", None)
        if master is not None:
            master.close()


class ForwardLinks:
    """A client's connections to nodes' forward ports, one per node per calling thread (as
    direct.py keeps its endpoints), until `close()` or until one fails."""

    def __init__(self, secret: ClusterSecret | None = None, timeout_s: float = 30.0,
                 shm_host_id: str | None = None) -> None:
        """`shm_host_id`: this host's `local_host_id()` when the client reaches same-host nodes
        through shared memory (a memcpy beats any request: such slots are not forwarded)."""
        self._secret = secret
        self._timeout_s = timeout_s
        self._shm_host_id = shm_host_id
        self._local = threading.local()
        self._all: list[RpcConnection] = []
        self._lock = threading.Lock()

    def route(self, slot: dict[str, Any]) -> str | None:
        """The forward port to send a put into `slot` to, or None to write it as before (more
        than one replica, a node without a forward port, or one reached by shared memory)."""
        address = slot.get("forward")
        replicas = slot["replicas"]
        if not isinstance(address, str) or len(replicas) != 1:
            return None
        segment = replicas[0].get("segment") or {}
        if self._shm_host_id is not None and segment.get("shm_name") \
                and segment.get("host_id") == self._shm_host_id:
            return None
        return address

    def put(self, address: str, slot: dict[str, Any], key: str, view: memoryview,
            checksum: int, reserve: list[Any]) -> dict[str, Any]:
        """One forwarded put into `slot` (its only replica on the node at `address`): the
        master's `put_slots` answer, relayed by the node. TransferFailed when the node
        refused the bytes, failed, or could not reach the master (the put may then have been
        committed with the node's replica lost; nothing partial is ever readable)."""
        conn = self._conn(address)
        replica = slot["replicas"][0]
        try:
            return dict(conn.call_with_payload(
                FORWARD_OP, view, key=key, slot=slot["slot"], offset=replica["offset"],
                version=replica["version"], checksum=checksum, reserve=reserve))
        except MasterUnavailable as exc:  # the node's connection, not the master's
            self._drop(address, conn)
            raise TransferFailed(f"put of {key!r}: node {replica.get('node_id')} at {address} "
                                 f"failed before acknowledging it: {exc}") from None
        except StoreError:
            raise
        except OSError as exc:
            self._drop(address, conn)
            raise TransferFailed(f"put of {key!r}: node at {address}: {exc}") from None

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()

    def _conn(self, address: str) -> RpcConnection:
        pool: dict[str, RpcConnection] | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = {}
        conn = pool.get(address)
        if conn is None:
            try:
                conn = RpcConnection(address, self._timeout_s, self._secret)
            except MasterUnavailable as exc:
                raise TransferFailed(f"cannot reach a node's forward port: {exc}") from None
            pool[address] = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _drop(self, address: str, conn: RpcConnection) -> None:
        self._local.pool.pop(address, None)
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()
