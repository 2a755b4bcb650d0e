"""`RemoteMaster`: the master's operations over TCP, with the same signatures as `MasterService`,
so the client and the node work the same against an in-process master or a remote one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvcake.auth import ClusterSecret
from kvcake.store.leader import connect
from kvcake.store.protocol import RpcConnection

T = TypeVar("T")


class RemoteMaster:
    def __init__(self, address: str, timeout_s: float = 30.0,
                 secret: ClusterSecret | None = None) -> None:
        self.address = address  # "HOST:PORT", or "etcd://..." to follow the elected master
        self._conn = connect(address, timeout_s, secret)
        self._inline_max: int | None = None  # inline_max_bytes, once asked

    def close(self) -> None:
        self._conn.close()

    def register_node(self, node_id: str, dram_bytes: int, disk_bytes: int,
                      endpoint: dict[str, Any], control_address: str | None = None,
                      objects: list[Any] | None = None) -> None:
        self._conn.call("register_node", node_id=node_id, dram_bytes=dram_bytes,
                        disk_bytes=disk_bytes, endpoint=endpoint,
                        control_address=control_address, objects=objects)

    def heartbeat(self, node_id: str, stats: dict[str, Any] | None = None) -> bool:
        return bool(self._conn.call("heartbeat", node_id=node_id, stats=stats))

    def unregister_node(self, node_id: str) -> list[str]:
        return list(self._conn.call("unregister_node", node_id=node_id))

    def put_start(self, key: str, size_bytes: int, checksum: int | None,
                  num_replicas: int | None = None,
                  local_node: str | None = None) -> list[dict[str, Any]]:
        return list(self._conn.call("put_start", key=key, size_bytes=size_bytes, checksum=checksum,
                                    num_replicas=num_replicas, local_node=local_node))

    def put_commit(self, key: str, checksum: int | None = None) -> None:
        self._conn.call("put_commit", key=key, checksum=checksum)

    def put_revoke(self, key: str) -> None:
        self._conn.call("put_revoke", key=key)

    def put_slots(self, commits: list[Any], reserve: list[Any] | None = None,
                  seal_later: bool = False) -> dict[str, Any]:
        return dict(self._conn.call("put_slots", commits=commits, reserve=reserve,
                                    seal_later=seal_later))

    def put_slots_overlapped(self, commits: list[Any], reserve: list[Any] | None,
                             work: Callable[[], T], seal_later: bool = False
                             ) -> tuple[dict[str, Any], T]:
        """`put_slots`, running `work()` here while the master handles it."""
        result, value = self._conn.call_overlapped(
            "put_slots", {"commits": commits, "reserve": reserve, "seal_later": seal_later},
            work)
        return dict(result), value

    def put_inline(self, key: str, data: memoryview, checksum: int,
                   num_replicas: int | None = None,
                   local_node: str | None = None) -> list[dict[str, Any]]:
        """The whole put in one request, to a master hosting a node (hosted.py): the frame,
        then `data`'s bytes (not copied)."""
        assert isinstance(self._conn, RpcConnection)  # never asked of an etcd-found master
        return list(self._conn.call_with_payload("put_inline", data, key=key, checksum=checksum,
                                                 num_replicas=num_replicas,
                                                 local_node=local_node))

    def inline_max_bytes(self) -> int:
        """The largest single put this master takes inline (`put_inline`), 0 if it hosts no
        node. Asked once per connection (the master's stats say it)."""
        if self._inline_max is None:
            hosted = self.stats().get("hosted_node") if not self.follows_leader else None
            self._inline_max = int(hosted["max_bytes"]) if isinstance(hosted, dict) else 0
        return self._inline_max

    def put_seal(self, keys: list[Any]) -> None:
        """One-way, sent now (gets of these keys wait for it)."""
        self._conn.send("put_seal", keys=keys)

    def release_slots(self, slots: list[Any]) -> None:
        """One-way, sent with this client's next request to the master."""
        self._conn.defer("release_slots", slots=slots)

    def touch(self, keys: list[Any]) -> None:
        """One-way; the keys touched until this client's next request to the master go with it,
        in one message handled before that request (so its evictions see them)."""
        self._conn.defer_items("touch", "keys", keys)

    @property
    def follows_leader(self) -> bool:
        """True when this master is found through etcd (it may change under the client)."""
        return not isinstance(self._conn, RpcConnection)

    def get(self, key: str) -> dict[str, Any]:
        return dict(self._conn.call("get", key=key))

    def release_leases(self, leases: list[Any]) -> None:
        """One-way, and sent with this client's next request to the master (same system call,
        no wake-up of the master of its own); until then, or `lease_s`, the leases hold."""
        self._conn.defer("release_leases", leases=leases)

    def flush(self) -> None:
        """Send deferred one-way requests (lease releases) now."""
        self._conn.flush()

    def exists(self, key: str) -> bool:
        return bool(self._conn.call("exists", key=key))

    def remove(self, key: str) -> None:
        self._conn.call("remove", key=key)

    def pin(self, key: str, pinned: bool) -> None:
        self._conn.call("pin", key=key, pinned=pinned)

    def add_replicas(self, key: str, num_replicas: int) -> dict[str, Any]:
        return dict(self._conn.call("add_replicas", key=key, num_replicas=num_replicas))

    def replicas_done(self, key: str, versions: list[int], ok: bool) -> None:
        self._conn.call("replicas_done", key=key, versions=versions, ok=ok)

    def drop_replicas(self, key: str, num_replicas: int) -> int:
        return int(self._conn.call("drop_replicas", key=key, num_replicas=num_replicas))

    def stats(self) -> dict[str, Any]:
        return dict(self._conn.call("stats"))

    def put_start_batch(self, items: list[Any], num_replicas: int | None = None,
                        local_node: str | None = None) -> list[Any]:
        return list(self._conn.call("put_start_batch", items=items, num_replicas=num_replicas,
                                    local_node=local_node))

    def put_start_batch_overlapped(self, items: list[Any], num_replicas: int | None,
                                   local_node: str | None, work: Callable[[], T]
                                   ) -> tuple[list[Any], T]:
        """`put_start_batch`, running `work()` here while the master allocates."""
        result, value = self._conn.call_overlapped(
            "put_start_batch", {"items": items, "num_replicas": num_replicas,
                                "local_node": local_node}, work)
        return list(result), value

    def put_commit_batch(self, keys: list[Any]) -> list[Any]:
        return list(self._conn.call("put_commit_batch", keys=keys))

    def get_batch(self, keys: list[Any]) -> list[Any]:
        return list(self._conn.call("get_batch", keys=keys))

    def exists_batch(self, keys: list[Any]) -> list[Any]:
        return list(self._conn.call("exists_batch", keys=keys))

    def remove_batch(self, keys: list[Any]) -> list[Any]:
        return list(self._conn.call("remove_batch", keys=keys))
