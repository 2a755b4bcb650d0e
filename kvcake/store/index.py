"""The master's metadata: key -> object -> replicas, and every policy decision about them.

Pure: the caller passes `now_s` and carries out the `TierAction`s this index queues (copies
between a node's DRAM segment and its disk, which only that node can do). Bytes never pass here.

Object lifecycle:
    put_start -> PENDING (replicas allocated) -> put_commit -> COMPLETE -> remove / evict / lost
                 `-- put_revoke, or put_timeout_s passes -> reclaimed
A COMPLETE object has one or more DRAM replicas and/or one DISK replica per node with a disk.
Eviction drops an object's DRAM replicas, demoting one to disk first where a disk has room; a get
of an object that lives only on disk promotes it back into that node's DRAM.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvcake.store.allocator import OffsetAllocator, OutOfSpace
from kvcake.store.config import MasterConfig
from kvcake.store.errors import InvalidRequest, NoNodes, NoSpace, ObjectExists, ObjectNotFound
from kvcake.store.eviction import LruOrder
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.objects import ActionKind, ObjectMeta, Replica, Tier, TierAction
from kvcake.store.placement import NodeInfo, order_nodes


@dataclass
class _Deferred:
    """A DRAM range of a removed replica, freed when its readers' leases end or are released."""

    node_id: str
    offset: int
    release_s: float
    lease_ids: set[int]


@dataclass
class StoreIndex:
    config: MasterConfig
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    lru: LruOrder = field(default_factory=LruOrder)  # objects with a DRAM replica
    disk_lru: LruOrder = field(default_factory=LruOrder)  # objects with a disk copy
    actions: list[TierAction] = field(default_factory=list)
    num_evicted: int = 0
    num_demoted: int = 0
    num_disk_evicted: int = 0
    _deferred: list[_Deferred] = field(default_factory=list)
    _next_version: int = 1
    _next_lease: int = 1
    _now_s: float = 0.0  # time of the public call in progress (passed in, never read here)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._rng.seed(self.config.seed)

    # ---- nodes -------------------------------------------------------------------------------
    def register_node(self, node_id: str, dram_bytes: int, disk_bytes: int,
                      endpoint: dict[str, Any], now_s: float) -> None:
        self._now_s = now_s
        if not node_id:
            raise InvalidRequest("node_id: must be a non-empty string")
        if dram_bytes <= 0 or disk_bytes < 0:
            raise InvalidRequest(f"dram_bytes/disk_bytes: got {dram_bytes}/{disk_bytes}")
        if node_id in self.nodes:  # a restart: whatever it held is gone
            self.remove_node(node_id)
        allocator = OffsetAllocator(dram_bytes, self.config.alignment_bytes)
        self.nodes[node_id] = NodeInfo(node_id, endpoint, allocator, disk_bytes, now_s)

    def heartbeat(self, node_id: str, now_s: float, stats: dict[str, Any] | None = None) -> bool:
        """False if the node is unknown (declared dead): it must register again."""
        self._now_s = now_s
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.last_heartbeat_s = now_s
        node.stats = stats or {}
        return True

    def remove_node(self, node_id: str) -> list[str]:
        """Forget a node and every replica on it; returns the keys lost entirely."""
        if self.nodes.pop(node_id, None) is None:
            return []
        self._deferred = [d for d in self._deferred if d.node_id != node_id]
        lost = []
        for meta in list(self.objects.values()):
            kept = [r for r in meta.replicas if r.node_id != node_id]
            if len(kept) == len(meta.replicas):
                continue
            meta.replicas = kept
            if not any(r.complete for r in kept) and meta.committed or not kept:
                lost.append(meta.key)
                self._forget(meta.key)
            elif not meta.dram():
                self.lru.discard(meta.key)
        return lost

    # ---- put ---------------------------------------------------------------------------------
    def put_start(self, key: str, size_bytes: int, checksum: int | None, num_replicas: int,
                  local_node: str | None, now_s: float) -> list[Replica]:
        """Allocate up to `num_replicas` DRAM replicas on distinct nodes (at least one). The
        payload's checksum may come now or with the commit (a writer computes it meanwhile)."""
        self._now_s = now_s
        self._check_key(key)
        if size_bytes < 0 or num_replicas < 1:
            raise InvalidRequest(f"size_bytes >= 0 and num_replicas >= 1, got {size_bytes}, "
                                 f"{num_replicas}")
        if key in self.objects:
            raise ObjectExists(f"key {key!r} is already stored or being written")
        alloc = size_bytes + HEADER_BYTES
        self._check_fits(alloc)
        order = order_nodes(list(self.nodes.values()), self.config.strategy, self._rng, local_node)
        replicas = self._allocate_on(order, alloc, num_replicas)
        meta = ObjectMeta(key, size_bytes, checksum, replicas, deadline_s=now_s + self.config.put_timeout_s)
        self.objects[key] = meta
        self._evict_to_watermark(now_s)
        return replicas

    def put_commit(self, key: str, now_s: float, checksum: int | None = None) -> None:
        self._now_s = now_s
        meta = self._pending(key)
        if checksum is not None:
            meta.checksum = checksum
        if meta.checksum is None:
            raise InvalidRequest(f"checksum: the put of {key!r} gave no payload checksum at "
                                 "start or commit")
        for replica in meta.replicas:
            replica.complete = True
        meta.committed = True
        self.lru.touch(key)
        self._evict_to_watermark(now_s)

    def put_revoke(self, key: str) -> None:
        self._pending(key)
        self._forget(key)

    # ---- get / exists / remove -----------------------------------------------------------------
    def get(self, key: str, now_s: float) -> ObjectMeta:
        """`get_leased` without the lease id (the lease then simply runs out)."""
        return self.get_leased(key, now_s)[0]

    def get_leased(self, key: str, now_s: float) -> tuple[ObjectMeta, int]:
        """The object with its complete DRAM replicas, and the id of a new read lease that
        protects them from eviction and reuse until `release` or `lease_s` from now. If it
        lives only on disk, a PROMOTE action is queued and the result has no DRAM replica yet:
        the caller runs the action, calls `promote_done`, then `get` again."""
        self._now_s = now_s
        meta = self.objects.get(key)
        if meta is None or not meta.committed:
            raise ObjectNotFound(f"key {key!r} is not in the store")
        lease_id = self._next_lease
        self._next_lease += 1
        meta.leases = {i: end for i, end in meta.leases.items() if end > now_s}
        meta.leases[lease_id] = now_s + self.config.lease_s
        if meta.disk():
            self.disk_lru.touch(key)
        if meta.dram():
            self.lru.touch(key)
        elif not any(r.tier is Tier.DRAM for r in meta.replicas):
            self._plan_promote(meta)
        return meta, lease_id

    def release(self, key: str, lease_id: int) -> None:
        """The read under `lease_id` is over: the object may be evicted again, and a range of
        it that was removed meanwhile is freed once no reader holds it. Unknown ids (expired,
        released twice, object gone) are ignored."""
        meta = self.objects.get(key)
        if meta is not None:
            meta.leases.pop(lease_id, None)
        for deferred in [d for d in self._deferred if lease_id in d.lease_ids]:
            deferred.lease_ids.discard(lease_id)
            if not deferred.lease_ids:
                self._deferred.remove(deferred)
                node = self.nodes.get(deferred.node_id)
                if node is not None:
                    node.allocator.free(deferred.offset)

    def promote_done(self, key: str, version: int, ok: bool, now_s: float) -> None:
        self._now_s = now_s
        meta = self.objects.get(key)
        replica = next((r for r in meta.replicas if r.version == version), None) if meta else None
        if meta is None or replica is None:
            return
        if ok:
            replica.complete = True
            self.lru.touch(key)
        else:
            meta.replicas.remove(replica)
            self._free_range(key, replica, 0.0)

    def disk_lost(self, key: str, disk_version: int) -> None:
        """A demote failed: forget that disk copy (and the object, if it was the last one)."""
        meta = self.objects.get(key)
        replica = next((r for r in meta.replicas if r.version == disk_version), None) if meta else None
        if meta is None or replica is None:
            return
        meta.replicas.remove(replica)
        node = self.nodes.get(replica.node_id)
        if node is not None:
            node.disk_used_bytes -= replica.alloc_bytes
        if not meta.replicas:
            self._forget(key)

    def exists(self, key: str) -> bool:
        meta = self.objects.get(key)
        return meta is not None and meta.committed

    def remove(self, key: str, now_s: float) -> None:
        self._now_s = now_s
        meta = self.objects.get(key)
        if meta is None or not meta.committed:
            raise ObjectNotFound(f"key {key!r} is not in the store")
        self._forget(key, release_s=meta.lease_until_s if meta.lease_until_s > now_s else 0.0)

    def set_pin(self, key: str, pinned: bool) -> None:
        meta = self.objects.get(key)
        if meta is None or not meta.committed:
            raise ObjectNotFound(f"key {key!r} is not in the store")
        meta.pinned = pinned

    # ---- replicas ----------------------------------------------------------------------------
    def add_replicas(self, key: str, num_replicas: int, now_s: float) -> list[Replica]:
        """New pending DRAM replicas that bring `key` up to `num_replicas` (the caller copies the
        bytes into them, then `replicas_done`)."""
        self._now_s = now_s
        meta = self.get(key, now_s)
        have = {r.node_id for r in meta.replicas if r.tier is Tier.DRAM}
        missing = num_replicas - len(have)
        if missing <= 0:
            return []
        order = [n for n in order_nodes(list(self.nodes.values()), self.config.strategy,
                                        self._rng, None) if n.node_id not in have]
        if not order:
            return []
        new = self._allocate_on(order, meta.size_bytes + HEADER_BYTES, missing)
        meta.replicas.extend(new)
        return new

    def replicas_done(self, key: str, versions: list[int], ok: bool, now_s: float) -> None:
        self._now_s = now_s
        meta = self.objects.get(key)
        if meta is None:
            return
        for replica in [r for r in meta.replicas if r.version in versions and not r.complete]:
            if ok:
                replica.complete = True
            else:
                meta.replicas.remove(replica)
                self._free_range(key, replica, 0.0)

    def drop_replicas(self, key: str, num_replicas: int, now_s: float) -> int:
        """Keep at most `num_replicas` (>= 1) DRAM replicas; returns how many were dropped."""
        self._now_s = now_s
        if num_replicas < 1:
            raise InvalidRequest(f"num_replicas: must be >= 1, got {num_replicas}")
        meta = self.get(key, now_s)
        extra = meta.dram()[num_replicas:]
        release = meta.lease_until_s if meta.lease_until_s > now_s else 0.0
        for replica in extra:
            meta.replicas.remove(replica)
            self._free_range(key, replica, release, meta)
        return len(extra)

    # ---- time ----------------------------------------------------------------------------------
    def expire(self, now_s: float) -> list[str]:
        """Reclaim timed-out puts and expired deferred frees; drop silent nodes. Returns the ids
        of the nodes declared dead."""
        self._now_s = now_s
        for meta in [m for m in self.objects.values() if not m.committed]:
            if meta.deadline_s <= now_s:
                self._forget(meta.key)
        due = [d for d in self._deferred if d.release_s <= now_s]
        self._deferred = [d for d in self._deferred if d.release_s > now_s]
        for d in due:
            if d.node_id in self.nodes:
                self.nodes[d.node_id].allocator.free(d.offset)
        dead = [n.node_id for n in self.nodes.values()
                if now_s - n.last_heartbeat_s > self.config.heartbeat_timeout_s]
        for node_id in dead:
            self.remove_node(node_id)
        return dead

    def take_actions(self) -> list[TierAction]:
        actions, self.actions = self.actions, []
        return actions

    def stats(self) -> dict[str, Any]:
        capacity = sum(n.allocator.capacity_bytes for n in self.nodes.values())
        used = sum(n.allocator.used_bytes for n in self.nodes.values())
        return {"num_nodes": len(self.nodes), "num_objects": sum(m.committed for m in
                self.objects.values()), "capacity_bytes": capacity, "used_bytes": used,
                "disk_used_bytes": sum(n.disk_used_bytes for n in self.nodes.values()),
                "num_evicted": self.num_evicted, "num_demoted": self.num_demoted,
                "num_disk_evicted": self.num_disk_evicted}

    # ---- internals -----------------------------------------------------------------------------
    def _check_key(self, key: object) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidRequest("key: must be a non-empty string")
        if len(key) > self.config.max_key_len:
            raise InvalidRequest(f"key: longer than max_key_len={self.config.max_key_len}")

    def _check_fits(self, alloc_bytes: int) -> None:
        if not self.nodes:
            raise NoNodes("no store node is registered: start `kvcake store node`")
        largest = max(n.allocator.capacity_bytes for n in self.nodes.values())
        if alloc_bytes > largest:
            raise InvalidRequest(
                f"object of {alloc_bytes - HEADER_BYTES} bytes is larger than any segment "
                f"(largest {largest} bytes, {HEADER_BYTES} of them per-object header): split it "
                "or give a node more DRAM")

    def _new_version(self) -> int:
        self._next_version += 1
        return self._next_version - 1

    def _allocate_on(self, order: list[NodeInfo], alloc: int, count: int) -> list[Replica]:
        """One replica on each of the first `count` nodes of `order` that can hold `alloc`
        bytes: first without evicting, then evicting LRU objects from the remaining nodes."""
        replicas: list[Replica] = []
        for evict in (False, True):
            for node in order:
                if len(replicas) == count:
                    return replicas
                if any(r.node_id == node.node_id for r in replicas):
                    continue
                offset = self._try_allocate(node, alloc, evict)
                if offset is not None:
                    replicas.append(Replica(node.node_id, Tier.DRAM, offset, alloc,
                                            self._new_version()))
        if not replicas:
            raise NoSpace(f"no segment can hold {alloc} bytes, even after eviction (the rest is "
                          "leased or being written)")
        return replicas

    def _try_allocate(self, node: NodeInfo, alloc: int, evict: bool) -> int | None:
        while True:
            try:
                return node.allocator.allocate(alloc)
            except OutOfSpace:
                if not evict:
                    return None
            if not self._evict(alloc, node.node_id):
                return None

    def _evict_to_watermark(self, now_s: float) -> None:
        capacity = sum(n.allocator.capacity_bytes for n in self.nodes.values())
        used = sum(n.allocator.used_bytes for n in self.nodes.values())
        if used > self.config.high_watermark * capacity:
            self._evict(int(used - self.config.low_watermark * capacity), None)

    def _evict(self, bytes_to_free: int, node_id: str | None) -> bool:
        """Evict LRU objects (with a DRAM replica on `node_id`, if given); True if any went.
        A leased object is never chosen; a pinned one only after every unpinned one."""
        def blocked(key: str) -> bool:
            meta = self.objects[key]
            if meta.lease_until_s > self._now_s:
                return True
            return node_id is not None and all(r.node_id != node_id for r in meta.dram())

        victims = self.lru.choose_victims(
            bytes_to_free, self._dram_bytes,
            blocked, lambda k: self.objects[k].pinned)
        for key in victims:
            self._evict_one(self.objects[key])
        return bool(victims)

    def _dram_bytes(self, key: str) -> int:
        """Bytes of DRAM the object's replicas take, alignment included."""
        return sum(self.nodes[r.node_id].allocator.aligned(r.alloc_bytes)
                   for r in self.objects[key].dram())

    def _evict_one(self, meta: ObjectMeta) -> None:
        self.num_evicted += 1
        dram = meta.dram()
        if not meta.disk():
            self._plan_demote(meta, dram)
        for replica in dram:
            meta.replicas.remove(replica)
            self._free_range(meta.key, replica, 0.0)
        self.lru.discard(meta.key)
        if not meta.replicas:
            del self.objects[meta.key]

    def _plan_demote(self, meta: ObjectMeta, dram: list[Replica]) -> None:
        for replica in dram:
            node = self.nodes[replica.node_id]
            if node.disk_free_bytes < replica.alloc_bytes:
                self._evict_disk(node, replica.alloc_bytes - node.disk_free_bytes)
            if node.disk_free_bytes >= replica.alloc_bytes:
                self.disk_lru.touch(meta.key)
                node.disk_used_bytes += replica.alloc_bytes
                disk = Replica(node.node_id, Tier.DISK, 0, replica.alloc_bytes,
                               self._new_version(), complete=True)
                meta.replicas.append(disk)
                self.actions.append(TierAction(ActionKind.DEMOTE, node.node_id, meta.key,
                                               replica.offset, replica.alloc_bytes,
                                               replica.version, disk.version))
                self.num_demoted += 1
                return

    def _evict_disk(self, node: NodeInfo, bytes_to_free: int) -> None:
        """Make room on `node`'s disk by dropping the disk copies of its least recently used
        objects (an object whose only copy that was is gone). Nothing is dropped unless enough
        room can be made: the object being demoted would be lost anyway."""
        victims: list[tuple[ObjectMeta, Replica]] = []
        freed = 0
        for key in self.disk_lru.oldest_first():
            if freed >= bytes_to_free:
                break
            meta = self.objects.get(key)
            if meta is None or not meta.disk():
                self.disk_lru.discard(key)  # gone since (this order is cleaned lazily)
                continue
            disk = next((r for r in meta.disk() if r.node_id == node.node_id), None)
            if disk is None or meta.lease_until_s > self._now_s:
                continue
            victims.append((meta, disk))
            freed += disk.alloc_bytes
        if freed < bytes_to_free:
            return
        for meta, disk in victims:
            self.num_disk_evicted += 1
            meta.replicas.remove(disk)
            self._free_range(meta.key, disk, 0.0)
            if not meta.disk():
                self.disk_lru.discard(meta.key)
            if not meta.replicas:
                self._forget(meta.key)

    def _plan_promote(self, meta: ObjectMeta) -> None:
        for disk in meta.disk():
            node = self.nodes[disk.node_id]
            offset = self._try_allocate(node, disk.alloc_bytes, evict=True)
            if offset is not None:
                replica = Replica(node.node_id, Tier.DRAM, offset, disk.alloc_bytes,
                                  self._new_version())
                meta.replicas.append(replica)
                self.actions.append(TierAction(ActionKind.PROMOTE, node.node_id, meta.key,
                                               offset, disk.alloc_bytes, replica.version,
                                               disk.version))
                return

    def _pending(self, key: str) -> ObjectMeta:
        meta = self.objects.get(key)
        if meta is None or meta.committed:
            raise ObjectNotFound(f"key {key!r} has no put in progress (timed out or revoked?)")
        return meta

    def _forget(self, key: str, release_s: float = 0.0) -> None:
        meta = self.objects.pop(key)
        self.lru.discard(key)
        self.disk_lru.discard(key)
        for replica in meta.replicas:
            self._free_range(key, replica, release_s, meta)

    def _free_range(self, key: str, replica: Replica, release_s: float,
                    meta: ObjectMeta | None = None) -> None:
        """Free a replica's space now, or (DRAM, `release_s` > 0) once the leases of `meta`'s
        current readers are released or `release_s` passes, whichever comes first."""
        node = self.nodes.get(replica.node_id)
        if node is None:
            return
        if replica.tier is Tier.DISK:
            node.disk_used_bytes -= replica.alloc_bytes
            self.actions.append(TierAction(ActionKind.DROP_DISK, node.node_id, key,
                                           disk_version=replica.version))
        elif release_s > 0:
            readers = {i for i, end in meta.leases.items() if end > self._now_s} if meta else set()
            self._deferred.append(_Deferred(node.node_id, replica.offset, release_s, readers))
        else:
            node.allocator.free(replica.offset)
