"""The store master: `MasterService`, a thread-safe service around the pure `StoreIndex` (its TCP
server is master_server.py, its handles on nodes node_handle.py, its list arguments master_args.py).

The master holds metadata only. Replica descriptors it hands out name a node's segment, an offset
and a version; clients move the bytes themselves through the transfer engine. The work the master
asks of nodes is moving an object between that node's DRAM and its disk, and revoking the
replicas it drops (`NodeHandle`).

Revocation is what lets a client remember where an object lives and read it later without asking
(reader.py's location cache) while staying linearizable with removes, evictions and overwrites:
every request that drops a committed DRAM replica has its node mark that replica's header revoked
(layout.revoke) before the request is answered, and a remembered location is read only if its
header is not revoked. A descriptor says `"revocable": true` only for nodes the master can ask
(a control handle with `revoke`); clients remember no other. A node the master cannot reach for a
revoke (it is declared dead, or its control port fails) is logged: until that node is gone, a
client that remembered one of its objects may still read it (the object's own checked bytes).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvcake.clock import Clock, SystemClock
from kvcake.store.config import MasterConfig
from kvcake.store.errors import InvalidRequest, NoSpace, StoreError, TransferFailed
from kvcake.store.index import ActionKind, ObjectMeta, Replica, StoreIndex
from kvcake.store.master_args import (
    batch_entry,
    commit_item,
    key_arg,
    key_checksum,
    key_size_checksum,
    reserve_spec,
)
from kvcake.store.node_handle import NodeHandle, RemoteNode, carry_out
from kvcake.store.rebuild import adopt

log = logging.getLogger(__name__)


def replica_desc(index: StoreIndex, replica: Replica, revocable: bool = False) -> dict[str, Any]:
    """A replica as clients see it; `revocable`: its node revokes what the master drops, so a
    client may remember this location (reader.py)."""
    node = index.nodes[replica.node_id]
    return {"node_id": replica.node_id, "segment": node.endpoint.get("segment"),
            "offset": replica.offset, "alloc_bytes": replica.alloc_bytes,
            "version": replica.version, "revocable": revocable}


class MasterService:
    """Every master operation, serialised by one lock. Methods mirror the wire ops."""

    def __init__(self, config: MasterConfig | None = None, clock: Clock | None = None,
                 mirror: bool = False, version_floor: int = 1) -> None:
        """`mirror`: tell every remote node which committed objects it holds (one-way, as each
        commit and remove happens), so that a new master can rebuild from the nodes (failover,
        rebuild.py). `version_floor`: the first replica version (above an earlier master's)."""
        self.config = config or MasterConfig()
        self.clock = clock or SystemClock()
        self.index = StoreIndex(self.config)
        self.index.space.raise_version_floor(version_floor)
        self.mirror = mirror
        self._handles: dict[str, NodeHandle] = {}
        self._no_revoke: set[str] = set()  # nodes whose revoke failed, until they register again
        self._lock = threading.RLock()
        self._sealed = threading.Condition(self._lock)  # notified when named objects seal or go

    # ---- nodes ---------------------------------------------------------------------------------
    def register_node(self, node_id: str, dram_bytes: int, disk_bytes: int,
                      endpoint: dict[str, Any], handle: NodeHandle | None = None,
                      objects: list[Any] | None = None) -> None:
        """`objects`: the committed objects the node holds (re-registering with a new master;
        rebuild.py), adopted as they are."""
        with self._lock:
            self.index.register_node(node_id, dram_bytes, disk_bytes, endpoint, self.clock.now_s())
            if handle is not None:
                self._handles[node_id] = handle
            self._no_revoke.discard(node_id)
            adopted = adopt(self.index, node_id, objects, self.clock.now_s()) if objects else 0
            # A node registering again: what it held is forgotten (revoked below, so no client
            # reads it from a remembered location) except what was just adopted, live again.
            live = {(node_id, r.offset, r.version) for meta in self.index.objects.values()
                    for r in meta.replicas if r.node_id == node_id}
            self.index.space.revoked[:] = [e for e in self.index.space.revoked if e not in live]
            offered = {(node_id, int(item[1]), int(item[3])) for item in objects or []}
            self.index.space.revoked.extend(sorted(offered - live))  # held, not adopted
            self._run_actions()
            log.info("node %s registered: %d DRAM bytes, %d disk bytes%s", node_id, dram_bytes,
                     disk_bytes, f", {adopted} of its {len(objects or [])} objects adopted"
                     if objects else "")

    def heartbeat(self, node_id: str, stats: dict[str, Any] | None = None) -> bool:
        with self._lock:
            return self.index.heartbeat(node_id, self.clock.now_s(), stats)

    def unregister_node(self, node_id: str) -> list[str]:
        with self._lock:
            lost = self.index.remove_node(node_id)
            self._run_actions()  # drop_disk actions for a gone node are skipped below
            handle = self._handles.pop(node_id, None)
        if isinstance(handle, RemoteNode):
            handle.close()
        if lost:
            log.warning("node %s left: %d objects lost with it", node_id, len(lost))
        return lost

    def tick(self) -> list[str]:
        """Expire leases, timed-out puts and silent nodes; returns the nodes declared dead."""
        with self._lock:
            now_s = self.clock.now_s()
            for node_id, local in self._handles.items():
                if not isinstance(local, RemoteNode):  # in-process nodes live as long as we do
                    self.index.heartbeat(node_id, now_s)
            dead = self.index.expire(now_s)
            self._sealed.notify_all()  # named objects reclaimed: their waiting gets answer
            self._run_actions()
        for node_id in dead:
            log.warning("node %s missed its heartbeats: declared dead", node_id)
            handle = self._handles.pop(node_id, None)
            if isinstance(handle, RemoteNode):
                handle.close()
        return dead

    # ---- objects -------------------------------------------------------------------------------
    def put_start(self, key: str, size_bytes: int, checksum: int | None,
                  num_replicas: int | None = None,
                  local_node: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            try:  # a put refused (NoSpace) after evicting still revokes what it evicted
                replicas = self.index.put_start(key, size_bytes, checksum,
                                                num_replicas or self.config.default_replicas,
                                                local_node, self.clock.now_s())
            finally:
                self._run_actions()
            return [self._desc(r) for r in replicas]

    def put_commit(self, key: str, checksum: int | None = None) -> None:
        """Make the object readable; `checksum` (of the payload) if put_start did not have it."""
        with self._lock:
            self.index.put_commit(key, self.clock.now_s(), checksum)
            if self.mirror:
                self._tell_nodes("hold", key)
            self._run_actions()

    def put_revoke(self, key: str) -> None:
        with self._lock:
            self.index.put_revoke(key)
            self._sealed.notify_all()

    def put_slots(self, commits: list[Any], reserve: list[Any] | None = None,
                  seal_later: bool = False) -> dict[str, Any]:
        """Commit objects written into slots and reserve new ones, in one request. With
        `seal_later`, each commit only names its slot (PENDING: the writer sends this before its
        bytes are written) and `put_seal` later makes it readable; a get of it meanwhile waits
        for that seal (up to `seal_wait_s`).
        `commits`: [[key, slot, size_bytes, checksum], ...], each answered as a batch entry
        (ObjectExists or a wrong size keep the slot reserved; ObjectNotFound: the slot is gone).
        `reserve`: [size_bytes, count, num_replicas or None, local_node or None] asks for up to
        `count` new slots, less one for each commit that kept its slot (the writer reuses it),
        and fewer, maybe none, when free space runs out.
        -> {"results": [entry per commit], "slots": [{"slot", "replicas", "ttl_s"}, ...]}"""
        items = [commit_item(c) for c in commits]
        spec = reserve_spec(reserve) if reserve is not None else None
        with self._lock:
            now_s = self.clock.now_s()
            if seal_later:
                results = [batch_entry(lambda c=c: self.index.name_slot(*c)) for c in items]
            else:
                results = [batch_entry(lambda c=c: self._commit_slot(c[0], c[1], c[2], c[3], now_s))
                           for c in items]
            slots: list[dict[str, Any]] = []
            if spec is not None:
                size, count, num_replicas, local_node = spec
                count -= sum(1 for r in results if not r["ok"]
                             and r["error"]["type"] in ("ObjectExists", "InvalidRequest"))
                try:
                    reserved = self.index.reserve(size, count,
                                                  num_replicas or self.config.default_replicas,
                                                  local_node, now_s) if count > 0 else []
                except NoSpace:
                    reserved = []
                slots = [self._slot_desc(slot_id, meta) for slot_id, meta in reserved]
            self._run_actions()
            return {"results": results, "slots": slots}

    def put_seal(self, keys: list[Any]) -> None:
        """The named objects `keys` are written and checked: make them readable (and wake the
        gets waiting for them). One-way on the wire: the writer does not wait."""
        if not all(isinstance(k, str) for k in keys):
            raise InvalidRequest("keys: each must be a string")
        with self._lock:
            now_s = self.clock.now_s()
            try:
                for key in keys:
                    self.index.seal(key, now_s)
                    if self.mirror:
                        self._tell_nodes("hold", key)
            finally:
                self._sealed.notify_all()
            self._run_actions()

    def _wait_seal(self, key: str) -> None:
        """Under the lock: if `key` is named and being sealed, wait (the lock released) until it
        is sealed or gone, or `seal_wait_s` passes."""
        meta = self.index.sealing(key)
        if meta is not None:
            self._sealed.wait_for(lambda: self.index.sealing(key) is not meta,
                                  timeout=self.config.seal_wait_s)

    def _commit_slot(self, key: str, slot: int, size_bytes: int, checksum: int, now: float) -> None:
        self.index.commit_slot(key, slot, size_bytes, checksum, now)
        if self.mirror:
            self._tell_nodes("hold", key)

    def release_slots(self, slots: list[Any]) -> None:
        """Free reserved slots a writer will not use. One-way on the wire."""
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in slots):
            raise InvalidRequest("slots: each must be an integer slot id")
        with self._lock:
            for slot in slots:
                self.index.release_slot(slot)

    def touch(self, keys: list[Any]) -> None:
        """Reads served from a client's location cache: refresh these objects' LRU place (no
        lease is taken; unknown keys are ignored). One-way on the wire."""
        if not all(isinstance(k, str) for k in keys):
            raise InvalidRequest("keys: each must be a string")
        with self._lock:
            for key in keys:
                self.index.touch(key)

    def get(self, key: str) -> dict[str, Any]:
        """{"size_bytes", "checksum", "replicas": [descriptor], "lease_id"}: the replicas are
        protected by a read lease until `release_leases` names it or `lease_s` passes."""
        with self._lock:
            self._wait_seal(key)
            meta, lease_id = self.index.get_leased(key, self.clock.now_s())
            if not meta.dram():
                self._run_actions()
                self.index.release(key, lease_id)
                meta, lease_id = self.index.get_leased(key, self.clock.now_s())
            if not meta.dram():
                raise TransferFailed(f"key {key!r} is on disk and could not be promoted")
            return {**self._describe(meta), "lease_id": lease_id}

    def release_leases(self, leases: list[Any]) -> None:
        """End the read leases [[key, lease_id], ...] (their reads are over). One-way on the
        wire: the client does not wait for it."""
        with self._lock:
            for item in leases:
                if not (isinstance(item, list | tuple) and len(item) == 2
                        and isinstance(item[0], str) and isinstance(item[1], int)):
                    raise InvalidRequest("leases: each must be [key, lease_id]")
                self.index.release(item[0], item[1])

    def exists(self, key: str) -> bool:
        with self._lock:
            self._wait_seal(key)
            return self.index.exists(key)

    def remove(self, key: str) -> None:
        with self._lock:
            if self.mirror:
                self._tell_nodes("forget", key)
            self.index.remove(key, self.clock.now_s())
            self._run_actions()

    def pin(self, key: str, pinned: bool) -> None:
        with self._lock:
            self.index.set_pin(key, pinned)

    def add_replicas(self, key: str, num_replicas: int) -> dict[str, Any]:
        """{"source": get result with its "lease_id", "targets": [new pending descriptors]}: the
        source replicas are leased for the copy; the caller releases the lease when it is done."""
        with self._lock:
            now_s = self.clock.now_s()
            try:  # refused (NoSpace) after evicting: what it evicted is still revoked
                new = self.index.add_replicas(key, num_replicas, now_s)
            finally:
                self._run_actions()
            meta, lease_id = self.index.get_leased(key, now_s)
            source = {**self._describe(meta), "lease_id": lease_id}
            source["replicas"] = [d for d in source["replicas"]
                                  if d["version"] not in {r.version for r in new}]
            return {"source": source, "targets": [self._desc(r) for r in new]}

    def replicas_done(self, key: str, versions: list[int], ok: bool) -> None:
        with self._lock:
            self.index.replicas_done(key, versions, ok, self.clock.now_s())

    def drop_replicas(self, key: str, num_replicas: int) -> int:
        with self._lock:
            dropped = self.index.drop_replicas(key, num_replicas, self.clock.now_s())
            self._run_actions()
            return dropped

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = self.index.stats()
            stats["nodes"] = {n.node_id: {"dram_used_bytes": n.allocator.used_bytes,
                                          "dram_bytes": n.allocator.capacity_bytes,
                                          "disk_used_bytes": n.disk_used_bytes}
                              for n in self.index.nodes.values()}
            return stats

    # ---- batches: one item's failure does not stop the others -------------------------------
    def put_start_batch(self, items: list[Any], num_replicas: int | None = None,
                        local_node: str | None = None) -> list[Any]:
        return [batch_entry(lambda it=it: self.put_start(*key_size_checksum(it), num_replicas,
                                                   local_node)) for it in items]

    def put_commit_batch(self, keys: list[Any]) -> list[Any]:
        """Each entry is a key, or [key, checksum] when put_start had no checksum."""
        return [batch_entry(lambda k=k: self.put_commit(*key_checksum(k))) for k in keys]

    def get_batch(self, keys: list[Any]) -> list[Any]:
        return [batch_entry(lambda k=k: self.get(key_arg(k))) for k in keys]

    def exists_batch(self, keys: list[Any]) -> list[Any]:
        return [batch_entry(lambda k=k: self.exists(key_arg(k))) for k in keys]

    def remove_batch(self, keys: list[Any]) -> list[Any]:
        return [batch_entry(lambda k=k: self.remove(key_arg(k))) for k in keys]

    # ---- internals -----------------------------------------------------------------------------
    def _describe(self, meta: ObjectMeta) -> dict[str, Any]:
        return {"size_bytes": meta.size_bytes, "checksum": meta.checksum,
                "replicas": [self._desc(r) for r in meta.dram()]}

    def _slot_desc(self, slot_id: int, meta: ObjectMeta) -> dict[str, Any]:
        """A reserved slot as its writer sees it; "forward": the address of the forward port
        (forward.py) of the node holding it, when it is the slot's only replica and has one."""
        desc = {"slot": slot_id, "ttl_s": self.config.put_timeout_s,
                "replicas": [self._desc(r) for r in meta.replicas]}
        if len(meta.replicas) == 1:
            forward = self.index.nodes[meta.replicas[0].node_id].endpoint.get("forward")
            if isinstance(forward, str):
                desc["forward"] = forward
        return desc

    def _desc(self, replica: Replica) -> dict[str, Any]:
        handle = self._handles.get(replica.node_id)
        revocable = hasattr(handle, "revoke") and replica.node_id not in self._no_revoke
        return replica_desc(self.index, replica, revocable)

    def _tell_nodes(self, op: str, key: str) -> None:
        """Mirror one object's DRAM replicas to the catalogues of the nodes holding them."""
        meta = self.index.objects.get(key)
        if meta is None:
            return
        for replica in meta.dram():
            handle = self._handles.get(replica.node_id)
            if isinstance(handle, RemoteNode):
                handle.tell(op, [[key, replica.offset, replica.alloc_bytes, replica.version,
                                  meta.size_bytes, meta.checksum or 0]] if op == "hold"
                            else [[key, replica.version]])

    def _run_actions(self) -> None:
        """Revoke the replicas the index dropped, then carry out the DRAM<->disk copies it asked
        for. Runs under the lock, before the request is answered (so before any freed range is
        handed to a writer): a remove is acknowledged only once its replicas are revoked, and a
        demote always reads the evicted bytes."""
        self._revoke(self.index.take_revoked())
        for action in self.index.take_actions():
            handle = self._handles.get(action.node_id)
            ok = handle is not None and carry_out(handle, action)
            if action.kind is ActionKind.PROMOTE:
                self.index.promote_done(action.key, action.version, ok, self.clock.now_s())
            elif action.kind is ActionKind.DEMOTE:
                self.index.demote_done(action.key, action.disk_version, ok)

    def _revoke(self, revoked: list[tuple[str, int, int]]) -> None:
        """Have each node revoke its dropped replicas (one call per node)."""
        if not revoked:  # most requests (every commit) drop nothing
            return
        by_node: dict[str, list[list[int]]] = {}
        for node_id, offset, version in revoked:
            by_node.setdefault(node_id, []).append([offset, version])
        for node_id, entries in by_node.items():
            handle = self._handles.get(node_id)
            if not hasattr(handle, "revoke") or node_id in self._no_revoke:
                continue  # its replicas are not described as revocable
            try:
                handle.revoke(entries)  # type: ignore[union-attr]
            except (StoreError, OSError, ValueError, LookupError) as exc:
                # No more revocable descriptors for it (and no more waits on it) until it
                # registers again; clients that remembered one of its replicas may still read it.
                self._no_revoke.add(node_id)
                log.error("node %s could not revoke %d dropped replicas: its replicas are no "
                          "longer described as revocable; a client that remembered one may "
                          "still read it there: %s", node_id, len(entries), exc)
