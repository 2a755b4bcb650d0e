"""`MasterServer`: the store master's `MasterService` on TCP (request dispatch, a node's
connection closing drops its replicas) and its reaper thread (`tick()`); `ReadyGate`, what holds
client requests while a new leader rebuilds from its nodes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvcake.auth import ClusterSecret
from kvcake.store.errors import InvalidRequest
from kvcake.store.master import MasterService
from kvcake.store.node_handle import RemoteNode
from kvcake.store.rpc_server import RpcServer

log = logging.getLogger(__name__)

_NODE_OPS = frozenset({"demote", "promote", "drop_disk", "revoke", "hold", "forget",
                       "put_forward"})
_UNGATED_OPS = frozenset({"heartbeat", "unregister_node"})  # served while a leader rebuilds


@dataclass(frozen=True)
class ReadyGate:
    """Client requests wait until `event` is set, at most `wait_s` each (node operations
    never wait: they are how the master gets ready)."""

    event: threading.Event = field(default_factory=threading.Event)
    wait_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.wait_s > 0:
            raise ValueError(f"wait_s: must be positive seconds, got {self.wait_s!r}")


class MasterServer:
    """`MasterService` on TCP, plus a reaper thread that calls `tick()` every `tick_interval_s`
    (None: no reaper; tests call `service.tick()` after moving their clock). With `secret`, only
    clients and nodes that prove it are served, and the master proves it to nodes' control ports."""

    def __init__(self, service: MasterService, host: str = "127.0.0.1", port: int = 0,
                 tick_interval_s: float | None = 0.5,
                 secret: ClusterSecret | None = None, ready: ReadyGate | None = None) -> None:
        """`ready` (a new leader rebuilding from its nodes): until its event is set (or its
        `wait_s` passes), only node operations are served; the others wait, so no client is told
        an object is missing that a node has not re-registered yet."""
        self.service = service
        self._ready = ready
        self._secret = secret
        self._server = RpcServer(self._handle, host, port, on_close=self._on_close,
                                 secret=secret)
        self._tick_interval_s = tick_interval_s
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self._server.address

    def start(self) -> MasterServer:
        self._server.start()
        if self._tick_interval_s is not None:
            self._reaper = threading.Thread(target=self._reap, name="store-reaper", daemon=True)
            self._reaper.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    def __enter__(self) -> MasterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reap(self) -> None:
        assert self._tick_interval_s is not None
        while not self._stop.wait(self._tick_interval_s):
            self.service.tick()

    def _handle(self, op: str, args: dict[str, Any], session: dict[str, Any]) -> Any:
        if op == "register_node":
            address = args.pop("control_address", None)
            handle = RemoteNode(address, self._secret) if address else None
            self.service.register_node(handle=handle, **args)
            session["node_id"] = args["node_id"]
            return None
        if op == "unregister_node":
            session.pop("node_id", None)
        if op in _NODE_OPS:
            raise InvalidRequest(f"op: {op!r} is a node operation, not a master one")
        if self._ready is not None and op not in _UNGATED_OPS:
            self._ready.event.wait(self._ready.wait_s)
        return getattr(self.service, op)(**args)

    def _on_close(self, session: dict[str, Any]) -> None:
        node_id = session.get("node_id")
        if node_id is not None and not self._stop.is_set():
            log.warning("node %s closed its connection: dropping its replicas", node_id)
            self.service.unregister_node(node_id)
