"""Tiering on its own: allocation that evicts LRU objects, watermark eviction, DRAM->disk demote
with a full disk making room, disk->DRAM promote, and the counters. Built as `StoreIndex`
builds it, over its own objects, LRU orders and NodeSpace; objects are committed by hand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvcake.store.allocator import OffsetAllocator
from kvcake.store.config import MasterConfig
from kvcake.store.errors import NoSpace
from kvcake.store.eviction import LruOrder
from kvcake.store.objects import ActionKind, ObjectMeta, Replica, Tier, TierAction
from kvcake.store.placement import NodeInfo
from kvcake.store.space import NodeSpace
from kvcake.store.tiering import Tiering

SLOT = 256  # one object's aligned bytes


@dataclass
class Pool:
    """One Tiering and the state it shares, with the steps the index would take around it."""

    tiers: Tiering

    @property
    def nodes(self) -> dict[str, NodeInfo]:
        return self.tiers.space.nodes

    @property
    def objects(self) -> dict[str, ObjectMeta]:
        return self.tiers.objects

    def counters(self) -> tuple[int, int]:
        """(evicted, dropped from disk); demotes are counted by the index once done."""
        return self.tiers.num_evicted, self.tiers.num_disk_evicted

    def take(self) -> list[TierAction]:
        actions = list(self.tiers.space.actions)
        self.tiers.space.actions.clear()
        return actions

    def put(self, key: str, *node_ids: str, now_s: float = 0.0, alloc: int = SLOT) -> ObjectMeta:
        """Allocate on `node_ids` (in that order) and commit, as put_start + put_commit do."""
        order = [self.nodes[n] for n in node_ids or list(self.nodes)[:1]]
        replicas = self.tiers.allocate_on(order, alloc, len(order), now_s)
        meta = ObjectMeta(key, alloc, 7, replicas, committed=True)
        for replica in replicas:
            replica.complete = True
        self.objects[key] = meta
        self.tiers.lru.touch(key)
        return meta

    def on_disk(self, key: str, node_id: str, alloc: int = SLOT) -> ObjectMeta:
        """A committed object whose only copy is on `node_id`'s disk, as a demote leaves it."""
        disk = Replica(node_id, Tier.DISK, 0, alloc, self.tiers.space.new_version(), True)
        self.objects[key] = ObjectMeta(key, alloc, 7, [disk], committed=True)
        self.nodes[node_id].disk_used_bytes += alloc
        self.tiers.disk_lru.touch(key)
        return self.objects[key]

    def lease(self, key: str, until_s: float) -> None:
        self.objects[key].leases[len(self.objects[key].leases) + 1] = until_s

    def used(self, node_id: str = "n0") -> int:
        return self.nodes[node_id].allocator.used_bytes


def make(*dram: int, disk: int = 0, high: float = 1.0, low: float = 1.0) -> Pool:
    """Nodes n0, n1, ... with `dram` bytes each (default one of 1024) and `disk` bytes of disk."""
    nodes = {f"n{i}": NodeInfo(f"n{i}", {}, OffsetAllocator(size, 64), disk, 0.0)
             for i, size in enumerate(dram or (1024,))}
    space = NodeSpace(nodes, [])
    config = MasterConfig(high_watermark=high, low_watermark=low)
    return Pool(Tiering(config, {}, space, LruOrder(), LruOrder()))


def where(meta: ObjectMeta) -> list[tuple[str, Tier, int, int]]:
    return [(r.node_id, r.tier, r.offset, r.version) for r in meta.replicas]


# ---- allocation -----------------------------------------------------------------------------
def test_allocate_hands_out_first_fit_offsets_and_fresh_versions() -> None:
    pool = make(1024)
    metas = [pool.put(key) for key in "abcd"]
    assert [where(m) for m in metas] == [[("n0", Tier.DRAM, i * SLOT, i + 1)] for i in range(4)]
    assert pool.take() == [] and pool.counters() == (0, 0)


def test_allocate_puts_one_replica_per_node_in_the_given_order() -> None:
    pool = make(1024, 1024, 1024)
    order = [pool.nodes[n] for n in ("n2", "n0", "n1")]
    two = pool.tiers.allocate_on(order, SLOT, 2, 0.0)
    assert [(r.node_id, r.offset, r.version, r.complete) for r in two] == [
        ("n2", 0, 1, False), ("n0", 0, 2, False)]
    more = pool.tiers.allocate_on(order, SLOT, 5, 0.0)  # at most one per node
    assert [(r.node_id, r.offset, r.version) for r in more] == [
        ("n2", SLOT, 3), ("n0", SLOT, 4), ("n1", 0, 5)]


def test_allocate_takes_a_node_with_room_before_evicting_on_an_earlier_one() -> None:
    pool = make(256, 1024)
    pool.put("a", "n0")
    (replica,) = pool.tiers.allocate_on([pool.nodes["n0"], pool.nodes["n1"]], SLOT, 1, 1.0)
    assert (replica.node_id, replica.offset) == ("n1", 0)
    assert list(pool.objects) == ["a"] and pool.counters() == (0, 0)


def test_allocate_evicts_the_least_recently_used_object_and_reuses_its_range() -> None:
    pool = make(1024)
    for key in "abcd":
        pool.put(key)
    pool.tiers.lru.touch("a")  # a read: b is now the least recently used
    (replica,) = pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)
    assert (replica.offset, replica.version) == (SLOT, 5)  # b's range, a new version
    assert list(pool.objects) == ["a", "c", "d"]
    assert pool.tiers.lru.oldest_first() == ["c", "d", "a"]
    assert pool.counters() == (1, 0) and pool.take() == []  # no disk: dropped, not demoted


def test_allocate_keeps_evicting_until_a_contiguous_range_is_free() -> None:
    pool = make(1024)
    for key in "abcd":
        pool.put(key)  # at 0, 256, 512, 768
    for key in "bd":
        pool.tiers.lru.touch(key)  # LRU order: a, c, b, d
    (replica,) = pool.tiers.allocate_on([pool.nodes["n0"]], 2 * SLOT, 1, 1.0)
    # a and c free 512 bytes but not side by side: eviction goes on for another 512 (b and d).
    assert replica.offset == 0
    assert pool.objects == {} and pool.counters() == (4, 0)


def test_allocate_evicts_only_objects_with_a_replica_on_the_node_it_needs() -> None:
    pool = make(256, 256)
    pool.put("a", "n0")  # the older
    pool.put("b", "n1")
    (replica,) = pool.tiers.allocate_on([pool.nodes["n1"]], SLOT, 1, 1.0)
    assert (replica.node_id, replica.offset) == ("n1", 0)
    assert list(pool.objects) == ["a"]


def test_eviction_frees_every_dram_replica_of_the_victim() -> None:
    pool = make(256, 512)
    pool.put("a", "n0", "n1")
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)
    assert "a" not in pool.objects
    assert (pool.used("n0"), pool.used("n1")) == (SLOT, 0)  # the new one; a's n1 copy went too


def test_a_leased_object_is_never_evicted_until_its_lease_ends() -> None:
    pool = make(512)
    pool.put("a")
    pool.put("b")
    pool.lease("a", 15.0)
    pool.lease("b", 15.0)
    with pytest.raises(NoSpace) as info:
        pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 14.999)
    assert str(info.value) == ("no segment can hold 256 bytes, even after eviction (the rest is "
                               "leased or being written)")
    assert list(pool.objects) == ["a", "b"] and pool.counters() == (0, 0)
    (replica,) = pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 15.0)  # ended at 15
    assert replica.offset == 0 and list(pool.objects) == ["b"]


def test_allocate_returns_fewer_replicas_when_only_some_nodes_can_hold_one() -> None:
    pool = make(256, 256)
    pool.put("held", "n0")  # version 1
    pool.lease("held", 100.0)
    order = [pool.nodes["n0"], pool.nodes["n1"]]
    assert [(r.node_id, r.version) for r in pool.tiers.allocate_on(order, SLOT, 2, 1.0)] == [
        ("n1", 2)]  # no NoSpace: one replica is enough
    assert list(pool.objects) == ["held"] and pool.counters() == (0, 0)


def test_pinned_objects_go_only_after_every_unpinned_one() -> None:
    pool = make(768)
    for key in "abc":
        pool.put(key)
    pool.objects["a"].pinned = True
    pool.objects["c"].pinned = True
    first = pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)
    assert first[0].offset == SLOT and sorted(pool.objects) == ["a", "c"]  # b, though newer
    second = pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)
    assert second[0].offset == 0 and list(pool.objects) == ["c"]  # then the oldest pinned


def test_an_allocation_that_cannot_succeed_evicts_nothing() -> None:
    pool = make(512)
    pool.put("a")
    pool.put("b")
    pool.lease("b", 100.0)
    with pytest.raises(NoSpace):
        pool.tiers.allocate_on([pool.nodes["n0"]], 2 * SLOT, 1, 1.0)
    assert list(pool.objects) == ["a", "b"]


# ---- watermarks -----------------------------------------------------------------------------
def test_watermark_eviction_starts_above_high_and_stops_at_low() -> None:
    pool = make(2048, high=0.875, low=0.5)  # 8 slots: evict above 7, down to 4
    for i in range(7):
        pool.put(f"k{i}")
    pool.tiers.evict_to_watermark(1.0)
    assert len(pool.objects) == 7  # 1792 is not above 0.875 * 2048
    pool.put("k7")
    pool.lease("k1", 10.0)  # leased: skipped, the next oldest goes instead
    pool.tiers.evict_to_watermark(1.0)
    assert sorted(pool.objects) == ["k1", "k5", "k6", "k7"]
    assert (pool.used(), pool.counters()) == (4 * SLOT, (4, 0))


def test_watermarks_count_the_whole_pool_not_one_node() -> None:
    pool = make(1024, 1024, high=0.9, low=0.1)
    for key in "abcd":
        pool.put(key, "n0")  # n0 is full, the pool half
    pool.tiers.evict_to_watermark(1.0)
    assert len(pool.objects) == 4


def test_watermark_eviction_counts_aligned_bytes() -> None:
    pool = make(1024, high=0.5, low=0.25)
    for key in "abcd":
        pool.put(key, alloc=100)  # 128 aligned bytes each: 512 used, not above 0.5
    pool.tiers.evict_to_watermark(1.0)
    assert len(pool.objects) == 4
    pool.put("e", alloc=100)  # 640 > 512: free 384 aligned bytes, i.e. three objects
    pool.tiers.evict_to_watermark(1.0)
    assert sorted(pool.objects) == ["d", "e"]


# ---- demote ---------------------------------------------------------------------------------
def test_an_evicted_object_is_demoted_to_its_nodes_disk() -> None:
    pool = make(256, disk=1024)
    pool.put("a")
    (new,) = pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)
    assert pool.take() == [TierAction(ActionKind.DEMOTE, "n0", "a", 0, SLOT, 1, 2)]
    assert where(pool.objects["a"]) == [("n0", Tier.DISK, 0, 2)]  # the disk version comes
    assert (new.offset, new.version) == (0, 3)  # before the new replica's
    assert pool.objects["a"].disk()[0].complete
    assert pool.nodes["n0"].disk_used_bytes == SLOT
    assert (pool.tiers.lru.oldest_first(), pool.tiers.disk_lru.oldest_first()) == ([], ["a"])
    assert pool.counters() == (1, 0)


def test_an_object_with_a_disk_copy_is_not_demoted_again() -> None:
    pool = make(256, disk=1024)
    meta = pool.put("a")
    meta.replicas.append(Replica("n0", Tier.DISK, 0, SLOT, 99, complete=True))
    pool.nodes["n0"].disk_used_bytes = SLOT
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)
    assert pool.take() == [] and where(pool.objects["a"]) == [("n0", Tier.DISK, 0, 99)]
    assert pool.nodes["n0"].disk_used_bytes == SLOT and pool.counters() == (1, 0)


def test_a_multi_replica_object_is_demoted_on_the_first_node_whose_disk_has_room() -> None:
    pool = make(256, 256, disk=SLOT)
    pool.nodes["n0"].disk_used_bytes = SLOT  # full, with nothing it may drop
    pool.put("a", "n0", "n1")
    pool.tiers.allocate_on([pool.nodes["n1"]], SLOT, 1, 1.0)
    (demote,) = pool.take()
    assert (demote.node_id, demote.version, demote.disk_version) == ("n1", 2, 3)
    assert where(pool.objects["a"]) == [("n1", Tier.DISK, 0, 3)]
    assert (pool.used("n0"), pool.nodes["n1"].disk_used_bytes) == (0, SLOT)


def test_a_full_disk_drops_its_least_recently_used_copies_to_take_a_demoted_object() -> None:
    pool = make(256, disk=2 * SLOT)
    for key in "abc":
        pool.put(key, now_s=1.0)  # a then b demoted: the disk is full
    pool.tiers.disk_lru.touch("a")  # a read: b is the disk's least recently used
    pool.take()
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 2.0)  # evicts c
    drop, demote = pool.take()
    assert drop == TierAction(ActionKind.DROP_DISK, "n0", "b", disk_version=4)
    assert (demote.kind, demote.key, demote.disk_version) == (ActionKind.DEMOTE, "c", 6)
    assert sorted(pool.objects) == ["a", "c"]  # b's disk copy was its last: b is gone
    assert pool.tiers.disk_lru.oldest_first() == ["a", "c"]
    assert pool.nodes["n0"].disk_used_bytes == 2 * SLOT and pool.counters() == (3, 1)


def test_a_dropped_disk_copy_keeps_an_object_that_still_has_dram() -> None:
    pool = make(256, 256, disk=SLOT)
    old = pool.put("old", "n1")
    old.replicas.append(Replica("n0", Tier.DISK, 0, SLOT, 50, complete=True))
    pool.nodes["n0"].disk_used_bytes = SLOT
    pool.tiers.disk_lru.touch("old")
    pool.put("a", "n0")
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)  # evicts a: its disk drops old's
    drop, demote = pool.take()
    assert (drop.kind, drop.key, drop.disk_version) == (ActionKind.DROP_DISK, "old", 50)
    assert (demote.kind, demote.key) == (ActionKind.DEMOTE, "a")
    assert where(pool.objects["old"]) == [("n1", Tier.DRAM, 0, 1)]
    assert pool.tiers.lru.oldest_first() == ["old"]  # still in DRAM
    assert pool.tiers.disk_lru.oldest_first() == ["a"]


def test_a_full_disk_drops_nothing_unless_that_makes_enough_room() -> None:
    pool = make(512, disk=2 * SLOT)
    pool.on_disk("p", "n0")
    pool.on_disk("q", "n0")  # the disk is full: p is leased, q alone frees 256 bytes
    pool.lease("p", 100.0)
    pool.put("big", alloc=2 * SLOT)
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)  # evicts big, which needs 512
    assert pool.take() == []  # q is kept: dropping it would not save big
    assert sorted(pool.objects) == ["p", "q"]  # big is lost
    assert pool.nodes["n0"].disk_used_bytes == 2 * SLOT and pool.counters() == (1, 0)


def test_the_disk_skips_other_nodes_copies_leased_ones_and_forgets_gone_keys() -> None:
    pool = make(256, 256, disk=2 * SLOT)
    pool.put("n1obj", "n1", now_s=1.0)
    pool.put("x", "n1", now_s=1.0)  # n1obj demoted to n1's disk
    pool.put("leased", "n0", now_s=1.0)
    pool.put("free", "n0", now_s=1.0)  # leased demoted to n0's disk
    pool.put("y", "n0", now_s=1.0)  # free demoted: n0's disk is full
    pool.tiers.disk_lru.touch("gone")  # a key whose object went: cleaned lazily
    pool.tiers.disk_lru.touch("free")  # the disk LRU: n1obj, leased, gone, free
    pool.lease("leased", 100.0)
    pool.take()
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 2.0)  # evicts y: free's copy goes
    drop, demote = pool.take()
    assert (drop.node_id, drop.key, demote.key) == ("n0", "free", "y")
    assert pool.tiers.disk_lru.oldest_first() == ["n1obj", "leased", "y"]
    assert "free" not in pool.objects and pool.counters() == (4, 1)


def test_a_full_disk_drops_soft_pinned_copies_only_after_every_unpinned_one() -> None:
    pool = make(512, disk=2 * SLOT)
    pool.on_disk("pinned", "n0").pinned = True
    pool.on_disk("newer", "n0")  # the disk is full; its LRU: pinned, newer
    pool.put("a")
    pool.put("b")  # DRAM is full
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 1.0)  # evicts a: its demote needs room
    drop, demote = pool.take()
    assert (drop.key, demote.key) == ("newer", "a")  # not the older, pinned copy
    assert sorted(pool.objects) == ["a", "b", "pinned"]
    pool.objects["a"].pinned = True  # now every copy on the disk is pinned: the oldest goes
    pool.tiers.allocate_on([pool.nodes["n0"]], SLOT, 1, 2.0)  # evicts b
    drop, demote = pool.take()
    assert (drop.key, demote.key) == ("pinned", "b")
    assert pool.tiers.disk_lru.oldest_first() == ["a", "b"] and pool.counters() == (2, 2)


# ---- promote --------------------------------------------------------------------------------
def test_promote_plans_a_pending_dram_replica_and_the_action_that_fills_it() -> None:
    pool = make(1024, disk=1024)
    pool.put("b")
    meta = pool.on_disk("a", "n0")  # disk version 2
    pool.tiers.plan_promote(meta, 1.0)
    assert where(meta) == [("n0", Tier.DISK, 0, 2), ("n0", Tier.DRAM, SLOT, 3)]
    assert not meta.replicas[1].complete  # a get serves it only after promote_done
    assert pool.take() == [TierAction(ActionKind.PROMOTE, "n0", "a", SLOT, SLOT, 3, 2)]
    assert pool.tiers.lru.oldest_first() == ["b"] and pool.counters() == (0, 0)


def test_promote_evicts_to_make_room_and_queues_the_demote_first() -> None:
    pool = make(256, disk=1024)
    pool.put("b")  # version 1
    meta = pool.on_disk("a", "n0")  # version 2
    pool.lease("a", 6.0)  # as get_leased does before planning
    pool.tiers.plan_promote(meta, 1.0)
    assert pool.take() == [TierAction(ActionKind.DEMOTE, "n0", "b", 0, SLOT, 1, 3),
                           TierAction(ActionKind.PROMOTE, "n0", "a", 0, SLOT, 4, 2)]
    assert pool.counters() == (1, 0)


def test_promote_never_drops_the_disk_copy_it_reads_from() -> None:
    pool = make(256, disk=SLOT)
    pool.put("b")
    meta = pool.on_disk("a", "n0")  # the disk is full with a's only copy
    pool.lease("a", 6.0)
    pool.tiers.plan_promote(meta, 1.0)  # b is evicted without a demote: a's copy is leased
    assert [(a.kind, a.key) for a in pool.take()] == [(ActionKind.PROMOTE, "a")]
    assert sorted(pool.objects) == ["a"] and pool.counters() == (1, 0)
    assert pool.nodes["n0"].disk_used_bytes == SLOT


def test_promote_goes_to_the_first_disk_copys_node_that_can_make_room() -> None:
    pool = make(256, 256, disk=1024)
    pool.put("held", "n0")
    pool.lease("held", 100.0)
    meta = pool.on_disk("a", "n0")
    meta.replicas += pool.on_disk("a2", "n1").replicas  # a second disk copy, on n1
    del pool.objects["a2"]
    pool.tiers.disk_lru.discard("a2")
    pool.tiers.plan_promote(meta, 1.0)
    (promote,) = pool.take()
    assert (promote.node_id, promote.offset, promote.disk_version) == ("n1", 0, 3)
    assert "held" in pool.objects and pool.counters() == (0, 0)


def test_a_promote_that_cannot_make_room_plans_nothing() -> None:
    pool = make(256, disk=1024)
    pool.put("held")
    pool.lease("held", 100.0)
    meta = pool.on_disk("a", "n0")
    pool.tiers.plan_promote(meta, 1.0)
    assert where(meta) == [("n0", Tier.DISK, 0, 2)]
    assert pool.take() == [] and list(pool.objects) == ["held", "a"]
    assert pool.tiers.space.new_version() == 3  # no version was spent on it
