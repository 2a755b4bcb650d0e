"""How the store master reaches a node: `NodeHandle`, what it may ask of one, and `RemoteNode`,
a node reached through its control port (an in-process `StoreNode` is its own handle).

The master asks a node to move an object between its DRAM and its disk (demote / promote /
drop_disk), to revoke the replicas it dropped (`revoke`, under the master's lock: a short timeout),
and, with failover on, tells it one-way which committed objects it holds (`tell`: hold / forget).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from kvcake.auth import ClusterSecret
from kvcake.store.errors import StoreError
from kvcake.store.index import ActionKind, TierAction
from kvcake.store.protocol import RpcConnection

log = logging.getLogger(__name__)


class NodeHandle(Protocol):
    """What the master may ask of a node. Each call returns when the copy is done or raises."""

    def demote(self, key: str, offset: int, alloc_bytes: int, version: int,
               disk_version: int) -> None: ...

    def promote(self, key: str, offset: int, alloc_bytes: int, version: int,
                disk_version: int) -> None: ...

    def drop_disk(self, key: str, disk_version: int) -> None: ...

    def revoke(self, entries: list[list[int]]) -> int:
        """Mark the replicas [[offset, version], ...] revoked (those still holding that
        version); returns how many were."""
        ...


_REVOKE_TIMEOUT_S = 5.0  # a revoke is a few header writes: a node slower than this is stuck


class RemoteNode:
    """A node reached through its control server (proving `secret` to it, if given)."""

    def __init__(self, address: str, secret: ClusterSecret | None = None) -> None:
        self._address = address
        self._secret = secret
        self._conn: RpcConnection | None = None
        self._revoke_conn: RpcConnection | None = None  # short timeout: it runs under the lock

    def _call(self, op: str, **args: Any) -> None:
        if self._conn is None:
            self._conn = RpcConnection(self._address, secret=self._secret)
        self._conn.call(op, **args)

    def demote(self, key: str, offset: int, alloc_bytes: int, version: int,
               disk_version: int) -> None:
        self._call("demote", key=key, offset=offset, alloc_bytes=alloc_bytes, version=version,
                   disk_version=disk_version)

    def promote(self, key: str, offset: int, alloc_bytes: int, version: int,
                disk_version: int) -> None:
        self._call("promote", key=key, offset=offset, alloc_bytes=alloc_bytes, version=version,
                   disk_version=disk_version)

    def drop_disk(self, key: str, disk_version: int) -> None:
        self._call("drop_disk", key=key, disk_version=disk_version)

    def revoke(self, entries: list[list[int]]) -> int:
        try:
            if self._revoke_conn is None:
                self._revoke_conn = RpcConnection(self._address, timeout_s=_REVOKE_TIMEOUT_S,
                                                  secret=self._secret)
            return int(self._revoke_conn.call("revoke", entries=entries))
        except (StoreError, OSError):
            conn, self._revoke_conn = self._revoke_conn, None  # reconnect next time
            if conn is not None:
                conn.close()
            raise

    def tell(self, op: str, objects: list[list[Any]]) -> None:
        """One-way `hold` / `forget` of catalogue entries (failover on); a node that cannot be
        reached misses them (it re-registers, or is declared dead, anyway)."""
        try:
            if self._conn is None:
                self._conn = RpcConnection(self._address, secret=self._secret)
            self._conn.send(op, objects=objects)
        except (StoreError, OSError) as exc:
            log.warning("could not tell node %s to %s %d objects: %s", self._address, op,
                        len(objects), exc)

    def close(self) -> None:
        for conn in (self._conn, self._revoke_conn):
            if conn is not None:
                conn.close()


def carry_out(handle: NodeHandle, action: TierAction) -> bool:
    """Have `handle`'s node do one DRAM<->disk action of the index; False (logged) if it failed."""
    try:
        if action.kind is ActionKind.DROP_DISK:
            handle.drop_disk(action.key, action.disk_version)
        else:
            method = handle.demote if action.kind is ActionKind.DEMOTE else handle.promote
            method(action.key, action.offset, action.alloc_bytes, action.version,
                   action.disk_version)
        return True
    except (StoreError, OSError, ValueError) as exc:
        log.warning("%s of %r on node %s failed: %s", action.kind.value, action.key,
                    action.node_id, exc)
        return False
