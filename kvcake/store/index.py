"""The master's metadata: key -> object -> replicas, and every policy decision about them.

Pure: the caller passes `now_s` and carries out the `TierAction`s this index queues (copies
between a node's DRAM segment and its disk, which only that node can do). Bytes never pass here.
The space replicas take lives in `space.py` (`NodeSpace`), eviction and DRAM<->disk moves in
`tiering.py` (`Tiering`), keyless allocations in `slots.py` (`SlotTable`); this module keeps the
objects and their lifecycle.

Object lifecycle:
    put_start -> PENDING (replicas allocated) -> put_commit -> COMPLETE -> remove / evict / lost
                 `-- put_revoke, or put_timeout_s passes -> reclaimed
    reserve -> SLOT (replicas allocated, no key yet) -> commit_slot(key) -> COMPLETE
       |       `-- release_slot, or put_timeout_s passes -> reclaimed
       `-> name_slot(key) -> PENDING, sealing -> seal -> COMPLETE
                             `-- put_revoke, or put_timeout_s passes -> reclaimed
A slot (slots.py) is a put_start made before its key is known; unclaimed, it is invisible to
readers, exactly like a PENDING object.
A COMPLETE object has one or more DRAM replicas and/or one DISK replica per node with a disk.
Eviction drops an object's DRAM replicas, demoting one to disk first where a disk has room; a get
of an object that lives only on disk promotes it back into that node's DRAM.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvcake.store.allocator import OffsetAllocator
from kvcake.store.config import MasterConfig
from kvcake.store.errors import InvalidRequest, ObjectExists, ObjectNotFound
from kvcake.store.eviction import LruOrder
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.leases import drop_expired, readers
from kvcake.store.objects import ActionKind, ObjectMeta, Replica, Tier, TierAction
from kvcake.store.placement import NodeInfo, order_nodes
from kvcake.store.slots import SlotTable
from kvcake.store.space import NodeSpace
from kvcake.store.tiering import Tiering

__all__ = ["ActionKind", "ObjectMeta", "Replica", "StoreIndex", "Tier", "TierAction"]


@dataclass
class StoreIndex:
    config: MasterConfig
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    lru: LruOrder = field(default_factory=LruOrder)  # objects with a DRAM replica
    disk_lru: LruOrder = field(default_factory=LruOrder)  # objects with a disk copy
    actions: list[TierAction] = field(default_factory=list)
    slots: dict[int, ObjectMeta] = field(default_factory=dict)  # slot id -> keyless allocation
    _next_lease: int = 1
    _num_demoted: int = 0  # DEMOTE actions their nodes reported done
    _rng: random.Random = field(default_factory=random.Random)
    space: NodeSpace = field(init=False, repr=False, compare=False)  # shares nodes, actions
    tiers: Tiering = field(init=False, repr=False, compare=False)  # shares objects, lru orders
    slot_table: SlotTable = field(init=False, repr=False, compare=False)  # shares slots, objects

    def __post_init__(self) -> None:
        self._rng.seed(self.config.seed)
        self.space = NodeSpace(self.nodes, self.actions)
        self.tiers = Tiering(self.config, self.objects, self.space, self.lru, self.disk_lru)
        self.slot_table = SlotTable(self.config, self.slots, self.objects, self.space, self.tiers)

    @property
    def num_evicted(self) -> int:
        return self.tiers.num_evicted

    @property
    def num_demoted(self) -> int:
        """Demotes carried out: a planned one counts once its node reports it done."""
        return self._num_demoted

    @property
    def num_disk_evicted(self) -> int:
        return self.tiers.num_disk_evicted

    # ---- nodes -------------------------------------------------------------------------------
    def register_node(self, node_id: str, dram_bytes: int, disk_bytes: int,
                      endpoint: dict[str, Any], now_s: float) -> None:
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
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.last_heartbeat_s = now_s
        node.stats = stats or {}
        return True

    def remove_node(self, node_id: str) -> list[str]:
        """Forget a node and every replica on it; returns the keys lost entirely."""
        if node_id not in self.nodes:
            return []
        self.space.revoked.extend(  # best effort: a gone node may not be reachable any more
            (node_id, r.offset, r.version) for meta in self.objects.values()
            for r in meta.replicas if r.node_id == node_id and r.tier is Tier.DRAM and r.complete)
        del self.nodes[node_id]
        self.space.forget_node(node_id)
        self.slot_table.release_on(node_id)
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
        self._check_key(key)
        if size_bytes < 0 or num_replicas < 1:
            raise InvalidRequest(f"size_bytes >= 0 and num_replicas >= 1, got {size_bytes}, "
                                 f"{num_replicas}")
        if key in self.objects:
            raise ObjectExists(f"key {key!r} is already stored or being written")
        alloc = size_bytes + HEADER_BYTES
        self.space.check_fits(alloc)
        replicas = self.tiers.allocate_on(self._order(local_node), alloc, num_replicas, now_s)
        meta = ObjectMeta(key, size_bytes, checksum, replicas, deadline_s=now_s + self.config.put_timeout_s)
        self.objects[key] = meta
        self.tiers.evict_to_watermark(now_s)
        return replicas

    def put_commit(self, key: str, now_s: float, checksum: int | None = None) -> None:
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
        self.tiers.evict_to_watermark(now_s)

    def put_revoke(self, key: str) -> None:
        self._pending(key)
        self._forget(key)

    def reserve(self, size_bytes: int, count: int, num_replicas: int, local_node: str | None,
                now_s: float) -> list[tuple[int, ObjectMeta]]:
        """Up to `count` keyless allocations (slots) of `size_bytes`, each placed as put_start
        would place it but only in free space (a slot never evicts: it is taken ahead of need);
        (slot id, its pending meta). Fewer, maybe none, when free space runs out."""
        return self.slot_table.reserve(size_bytes, count, num_replicas,
                                       lambda: self._order(local_node), now_s)

    def name_slot(self, key: str, slot_id: int, size_bytes: int, checksum: int) -> None:
        """Give slot `slot_id` its key and checksum, still PENDING (its bytes are being written;
        `seal` commits it). The same errors as `commit_slot`, which keep the slot reserved."""
        slot = self._claim_slot(key, slot_id, size_bytes)
        slot.checksum, slot.sealing = checksum, True

    def seal(self, key: str, now_s: float) -> None:
        """Commit an object named from a slot (its writer's bytes are written and checked).
        ObjectNotFound if it is not a named object waiting for its seal."""
        meta = self.objects.get(key)
        if meta is None or meta.committed or not meta.sealing:
            raise ObjectNotFound(f"key {key!r} has no named put waiting for its seal")
        meta.sealing = False
        self.put_commit(key, now_s)

    def sealing(self, key: str) -> ObjectMeta | None:
        """The object `key` if it is named and waiting for its seal."""
        meta = self.objects.get(key)
        return meta if meta is not None and meta.sealing and not meta.committed else None

    def commit_slot(self, key: str, slot_id: int, size_bytes: int, checksum: int,
                    now_s: float) -> ObjectMeta:
        """Name slot `slot_id` `key` and commit it (its bytes are written and checked). The slot
        stays reserved when the key exists (ObjectExists) or the size differs (InvalidRequest);
        ObjectNotFound if the slot is unknown (timed out, released, its node gone)."""
        slot = self._claim_slot(key, slot_id, size_bytes)
        self.put_commit(key, now_s, checksum)
        return slot

    def _claim_slot(self, key: str, slot_id: int, size_bytes: int) -> ObjectMeta:
        """Slot `slot_id` becomes the uncommitted object `key`; on any error it stays a slot."""
        self._check_key(key)
        return self.slot_table.claim(key, slot_id, size_bytes)

    def release_slot(self, slot_id: int) -> None:
        """Free a slot that will not be used (unknown ids are ignored)."""
        self.slot_table.release(slot_id)

    # ---- get / exists / remove -----------------------------------------------------------------
    def get(self, key: str, now_s: float) -> ObjectMeta:
        """`get_leased` without the lease id (the lease then simply runs out)."""
        return self.get_leased(key, now_s)[0]

    def get_leased(self, key: str, now_s: float) -> tuple[ObjectMeta, int]:
        """The object with its complete DRAM replicas, and the id of a new read lease that
        protects them from eviction and reuse until `release` or `lease_s` from now. If it
        lives only on disk, a PROMOTE action is queued and the result has no DRAM replica yet:
        the caller runs the action, calls `promote_done`, then `get` again."""
        meta = self._committed(key)
        lease_id = self._next_lease
        self._next_lease += 1
        drop_expired(meta.leases, now_s)
        meta.leases[lease_id] = now_s + self.config.lease_s
        if meta.disk():
            self.disk_lru.touch(key)
        if meta.dram():
            self.lru.touch(key)
        elif not any(r.tier is Tier.DRAM for r in meta.replicas):
            self.tiers.plan_promote(meta, now_s)
        return meta, lease_id

    def touch(self, key: str) -> None:
        """A read that took no lease (a client's cached location): refresh its LRU place."""
        meta = self.objects.get(key)
        if meta is not None and meta.committed and meta.dram():
            self.lru.touch(key)

    def _committed(self, key: str) -> ObjectMeta:
        """The committed object `key`, without touching leases or LRU order."""
        meta = self.objects.get(key)
        if meta is None or not meta.committed:
            raise ObjectNotFound(f"key {key!r} is not in the store")
        return meta

    def release(self, key: str, lease_id: int) -> None:
        """The read under `lease_id` is over: the object may be evicted again, and a range of
        it that was removed meanwhile is freed once no reader holds it. Unknown ids (expired,
        released twice, object gone) are ignored."""
        meta = self.objects.get(key)
        if meta is not None:
            meta.leases.pop(lease_id, None)
        self.space.release(lease_id)

    def promote_done(self, key: str, version: int, ok: bool, now_s: float) -> None:
        self.tiers.promote_done(key, version, ok)

    def demote_done(self, key: str, disk_version: int, ok: bool) -> None:
        """A node carried out (`ok`) or failed a DEMOTE: count it, or forget that disk copy."""
        if ok:
            self._num_demoted += 1
        else:
            self.disk_lost(key, disk_version)

    def disk_lost(self, key: str, disk_version: int) -> None:
        """A demote failed: forget that disk copy (and the object, if it was the last one)."""
        if self.tiers.drop_disk_copy(key, disk_version):
            self._forget(key)

    def exists(self, key: str) -> bool:
        meta = self.objects.get(key)
        return meta is not None and meta.committed

    def remove(self, key: str, now_s: float) -> None:
        meta = self.objects.get(key)
        if meta is None or not meta.committed:
            raise ObjectNotFound(f"key {key!r} is not in the store")
        self._forget(key, release_s=meta.lease_until_s if meta.lease_until_s > now_s else 0.0,
                     now_s=now_s)

    def set_pin(self, key: str, pinned: bool) -> None:
        meta = self.objects.get(key)
        if meta is None or not meta.committed:
            raise ObjectNotFound(f"key {key!r} is not in the store")
        meta.pinned = pinned

    # ---- replicas ----------------------------------------------------------------------------
    def add_replicas(self, key: str, num_replicas: int, now_s: float) -> list[Replica]:
        """New pending DRAM replicas that bring `key` up to `num_replicas` (the caller copies the
        bytes into them, then `replicas_done`). Takes no lease: the caller leases the source it
        copies from (`get_leased`)."""
        meta = self._committed(key)
        have = {r.node_id for r in meta.replicas if r.tier is Tier.DRAM}
        missing = num_replicas - len(have)
        if missing <= 0:
            return []
        order = [n for n in self._order(None) if n.node_id not in have]
        if not order:
            return []
        new = self.tiers.allocate_on(order, meta.size_bytes + HEADER_BYTES, missing, now_s)
        meta.replicas.extend(new)
        return new

    def replicas_done(self, key: str, versions: list[int], ok: bool, now_s: float) -> None:
        meta = self.objects.get(key)
        if meta is None:
            return
        for replica in [r for r in meta.replicas if r.version in versions and not r.complete]:
            if ok:
                replica.complete = True
            else:
                meta.replicas.remove(replica)
                self.space.free_range(key, replica)

    def drop_replicas(self, key: str, num_replicas: int, now_s: float) -> int:
        """Keep at most `num_replicas` (>= 1) DRAM replicas; returns how many were dropped."""
        if num_replicas < 1:
            raise InvalidRequest(f"num_replicas: must be >= 1, got {num_replicas}")
        meta = self._committed(key)  # no lease of its own: it would hold back the free below
        extra = meta.dram()[num_replicas:]
        release = meta.lease_until_s if meta.lease_until_s > now_s else 0.0
        for replica in extra:
            meta.replicas.remove(replica)
            self.space.free_range(key, replica, release, readers(meta, now_s))
        return len(extra)

    # ---- time ----------------------------------------------------------------------------------
    def expire(self, now_s: float) -> list[str]:
        """Reclaim timed-out puts and expired deferred frees; drop silent nodes. Returns the ids
        of the nodes declared dead."""
        for meta in [m for m in self.objects.values() if not m.committed]:
            if meta.deadline_s <= now_s:
                self._forget(meta.key)
        self.slot_table.expire(now_s)
        self.space.expire(now_s)
        dead = [n.node_id for n in self.nodes.values()
                if now_s - n.last_heartbeat_s > self.config.heartbeat_timeout_s]
        for node_id in dead:
            self.remove_node(node_id)
        return dead

    def take_revoked(self) -> list[tuple[str, int, int]]:
        """The committed DRAM replicas dropped since the last call: (node_id, offset, version),
        for the master to have their nodes revoke (layout.revoke)."""
        revoked = list(self.space.revoked)
        self.space.revoked.clear()
        return revoked

    def take_actions(self) -> list[TierAction]:
        actions = list(self.actions)
        self.actions.clear()  # cleared, not rebound: `space` and `tiers` queue onto this list
        return actions

    def stats(self) -> dict[str, Any]:
        capacity = sum(n.allocator.capacity_bytes for n in self.nodes.values())
        allocated = sum(n.allocator.used_bytes for n in self.nodes.values())
        # space writers hold for their next puts (slots) is reserved, not used: it holds no object
        reserved = self.slot_table.reserved_bytes(self.nodes)
        return {"num_nodes": len(self.nodes), "num_objects": sum(m.committed for m in
                self.objects.values()), "capacity_bytes": capacity,
                "used_bytes": allocated - reserved, "slot_bytes": reserved,
                "disk_used_bytes": sum(n.disk_used_bytes for n in self.nodes.values()),
                "num_evicted": self.num_evicted, "num_demoted": self.num_demoted,
                "num_disk_evicted": self.num_disk_evicted}

    # ---- internals -----------------------------------------------------------------------------
    def _order(self, local_node: str | None) -> list[NodeInfo]:
        """The nodes for a new replica, best first (the random strategy draws from `_rng`)."""
        return order_nodes(list(self.nodes.values()), self.config.strategy, self._rng, local_node)

    def _check_key(self, key: object) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidRequest("key: must be a non-empty string")
        if len(key) > self.config.max_key_len:
            raise InvalidRequest(f"key: longer than max_key_len={self.config.max_key_len}")

    def _pending(self, key: str) -> ObjectMeta:
        meta = self.objects.get(key)
        if meta is None or meta.committed:
            raise ObjectNotFound(f"key {key!r} has no put in progress (timed out or revoked?)")
        return meta

    def _forget(self, key: str, release_s: float = 0.0, now_s: float = 0.0) -> None:
        """Drop the object and free its replicas (DRAM ranges its readers at `now_s` still hold
        are freed when they finish or at `release_s`, if that is > 0)."""
        meta = self.objects.pop(key)
        self.lru.discard(key)
        self.disk_lru.discard(key)
        holders = readers(meta, now_s)
        for replica in meta.replicas:
            self.space.free_range(key, replica, release_s, holders)

