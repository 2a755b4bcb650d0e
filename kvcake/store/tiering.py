"""Which objects leave DRAM when space is needed, and the DRAM<->disk copies that follow.

Pure policy for `StoreIndex` (times are passed in; bytes never pass here). A new replica is
placed without evicting if it can be, else by evicting least recently used objects: a leased
object never, a soft-pinned one only after every unpinned one. An evicted object is demoted to
its node's disk first where the disk has (or can make) room; a full disk drops its own least
recently used copies (the same leases and soft pins) only if that makes enough room. A get of an object that lives only on disk
plans its promotion back into DRAM. Every copy is a `TierAction` queued for the node.
"""

from __future__ import annotations

from kvcake.store.allocator import OutOfSpace
from kvcake.store.config import MasterConfig
from kvcake.store.errors import NoSpace
from kvcake.store.eviction import LruOrder
from kvcake.store.objects import ActionKind, ObjectMeta, Replica, Tier, TierAction
from kvcake.store.placement import NodeInfo
from kvcake.store.space import NodeSpace


class Tiering:
    """Eviction and tier moves over the index's `objects` and LRU orders (shared, never
    rebound): `lru` holds the objects with a DRAM replica, `disk_lru` those with a disk copy
    (cleaned lazily). Counts what it evicted and dropped from disk; a demote is only planned
    here (a DEMOTE action), and counted by the index once its node reports it done."""

    def __init__(self, config: MasterConfig, objects: dict[str, ObjectMeta], space: NodeSpace,
                 lru: LruOrder, disk_lru: LruOrder) -> None:
        self.config = config
        self.objects = objects
        self.space = space
        self.lru = lru
        self.disk_lru = disk_lru
        self.num_evicted = 0
        self.num_disk_evicted = 0

    def allocate_on(self, order: list[NodeInfo], alloc: int, count: int,
                    now_s: float, evict: bool = True) -> list[Replica]:
        """One replica on each of the first `count` nodes of `order` that can hold `alloc`
        bytes: first without evicting, then (`evict`) evicting LRU objects from the remaining
        nodes. NoSpace if not even one fits."""
        replicas: list[Replica] = []
        for evicting in (False, True) if evict else (False,):
            for node in order:
                if len(replicas) == count:
                    return replicas
                if any(r.node_id == node.node_id for r in replicas):
                    continue
                offset = self._try_allocate(node, alloc, evicting, now_s)
                if offset is not None:
                    replicas.append(Replica(node.node_id, Tier.DRAM, offset, alloc,
                                            self.space.new_version()))
        if not replicas:
            raise NoSpace(f"no segment can hold {alloc} bytes, even after eviction (the rest is "
                          "leased or being written)")
        return replicas

    def evict_to_watermark(self, now_s: float) -> None:
        """Above `high_watermark` of the pool's DRAM, evict down to `low_watermark`."""
        nodes = self.space.nodes.values()
        capacity = sum(n.allocator.capacity_bytes for n in nodes)
        used = sum(n.allocator.used_bytes for n in nodes)
        if used > self.config.high_watermark * capacity:
            self._evict(int(used - self.config.low_watermark * capacity), None, now_s)

    def plan_promote(self, meta: ObjectMeta, now_s: float) -> None:
        """A pending DRAM replica on the first node of a disk copy that can make room, and the
        PROMOTE action that fills it; nothing if none can."""
        for disk in meta.disk():
            node = self.space.nodes[disk.node_id]
            offset = self._try_allocate(node, disk.alloc_bytes, evict=True, now_s=now_s)
            if offset is not None:
                replica = Replica(node.node_id, Tier.DRAM, offset, disk.alloc_bytes,
                                  self.space.new_version())
                meta.replicas.append(replica)
                self.space.actions.append(TierAction(ActionKind.PROMOTE, node.node_id,
                                                     meta.key, offset, disk.alloc_bytes,
                                                     replica.version, disk.version))
                return

    def promote_done(self, key: str, version: int, ok: bool) -> None:
        """A node filled (`ok`) or failed the pending DRAM replica `version` of a PROMOTE: it
        becomes readable, or is dropped and its range freed. Unknown ones are ignored."""
        meta = self.objects.get(key)
        replica = next((r for r in meta.replicas if r.version == version), None) if meta else None
        if meta is None or replica is None:
            return
        if ok:
            replica.complete = True
            self.lru.touch(key)
        else:
            meta.replicas.remove(replica)
            self.space.free_range(key, replica)

    def drop_disk_copy(self, key: str, disk_version: int) -> bool:
        """Forget the disk copy `disk_version` of `key` (its demote failed) and give its node
        the disk bytes back; True if the object has no replica left (the caller forgets it)."""
        meta = self.objects.get(key)
        replica = next((r for r in meta.replicas if r.version == disk_version), None) if meta else None
        if meta is None or replica is None:
            return False
        meta.replicas.remove(replica)
        node = self.space.nodes.get(replica.node_id)
        if node is not None:
            node.disk_used_bytes -= replica.alloc_bytes
        return not meta.replicas

    def _try_allocate(self, node: NodeInfo, alloc: int, evict: bool, now_s: float) -> int | None:
        while True:
            try:
                return node.allocator.allocate(alloc)
            except OutOfSpace:
                if not evict:
                    return None
            if not self._evict(alloc, node.node_id, now_s):
                return None

    def _evict(self, bytes_to_free: int, node_id: str | None, now_s: float) -> bool:
        """Evict LRU objects (with a DRAM replica on `node_id`, if given); True if any went.
        A leased object is never chosen; a pinned one only after every unpinned one. For a
        node: nothing goes when even every candidate and the node's free bytes together could
        not hold `bytes_to_free` (the allocation would fail anyway, its victims lost for
        nothing)."""
        def blocked(key: str) -> bool:
            meta = self.objects[key]
            if meta.lease_until_s > now_s:
                return True
            return node_id is not None and all(r.node_id != node_id for r in meta.dram())

        victims = self.lru.choose_victims(
            bytes_to_free, self._dram_bytes,
            blocked, lambda k: self.objects[k].pinned)
        if node_id is not None:
            node = self.space.nodes[node_id]
            on_node = sum(node.allocator.aligned(r.alloc_bytes) for key in victims
                          for r in self.objects[key].dram() if r.node_id == node_id)
            if on_node + node.allocator.free_bytes < node.allocator.aligned(bytes_to_free):
                return False
        for key in victims:
            self._evict_one(self.objects[key], now_s)
        return bool(victims)

    def _dram_bytes(self, key: str) -> int:
        """Bytes of DRAM the object's replicas take, alignment included."""
        return sum(self.space.nodes[r.node_id].allocator.aligned(r.alloc_bytes)
                   for r in self.objects[key].dram())

    def _evict_one(self, meta: ObjectMeta, now_s: float) -> None:
        self.num_evicted += 1
        dram = meta.dram()
        if not meta.disk():
            self._plan_demote(meta, dram, now_s)
        for replica in dram:
            meta.replicas.remove(replica)
            self.space.free_range(meta.key, replica)
        self.lru.discard(meta.key)
        if not meta.replicas:
            del self.objects[meta.key]

    def _plan_demote(self, meta: ObjectMeta, dram: list[Replica], now_s: float) -> None:
        for replica in dram:
            node = self.space.nodes[replica.node_id]
            if node.disk_free_bytes < replica.alloc_bytes:
                self._evict_disk(node, replica.alloc_bytes - node.disk_free_bytes, now_s)
            if node.disk_free_bytes >= replica.alloc_bytes:
                self.disk_lru.touch(meta.key)
                node.disk_used_bytes += replica.alloc_bytes
                disk = Replica(node.node_id, Tier.DISK, 0, replica.alloc_bytes,
                               self.space.new_version(), complete=True)
                meta.replicas.append(disk)
                self.space.actions.append(TierAction(ActionKind.DEMOTE, node.node_id, meta.key,
                                                     replica.offset, replica.alloc_bytes,
                                                     replica.version, disk.version))
                return

    def _evict_disk(self, node: NodeInfo, bytes_to_free: int, now_s: float) -> None:
        """Make room on `node`'s disk by dropping the disk copies of its least recently used
        objects (an object whose only copy that was is gone): never a leased one, a soft-pinned
        one only after every unpinned one, as in DRAM. Nothing is dropped unless enough room
        can be made: the object being demoted would be lost anyway."""
        for key in self.disk_lru.oldest_first():
            meta = self.objects.get(key)
            if meta is None or not meta.disk():
                self.disk_lru.discard(key)  # gone since (this order is cleaned lazily)

        def on_node(key: str) -> Replica | None:
            return next((r for r in self.objects[key].disk() if r.node_id == node.node_id), None)

        def blocked(key: str) -> bool:
            return on_node(key) is None or self.objects[key].lease_until_s > now_s

        def size(key: str) -> int:
            replica = on_node(key)
            return 0 if replica is None else replica.alloc_bytes

        keys = self.disk_lru.choose_victims(bytes_to_free, size, blocked,
                                            lambda k: self.objects[k].pinned)
        if sum(size(key) for key in keys) < bytes_to_free:
            return
        for key in keys:
            meta, disk = self.objects[key], on_node(key)
            assert disk is not None  # chosen only if it has a copy on this node
            self.num_disk_evicted += 1
            meta.replicas.remove(disk)
            self.space.free_range(meta.key, disk)
            if not meta.disk():
                self.disk_lru.discard(meta.key)
            if not meta.replicas:  # its last copy: the object is gone
                del self.objects[meta.key]
                self.lru.discard(meta.key)
