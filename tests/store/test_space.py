"""NodeSpace on its own: versions, the fits-any-segment check, and freeing DRAM ranges and disk
bytes, at once or (under read leases) when the last reader releases or the deadline passes."""

from __future__ import annotations

import pytest

from kvcake.store.allocator import OffsetAllocator, OutOfSpace
from kvcake.store.errors import InvalidRequest, NoNodes
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.objects import ActionKind, Replica, Tier, TierAction
from kvcake.store.placement import NodeInfo
from kvcake.store.space import NodeSpace

SLOT = 256  # one range: a multiple of the alignment, so offsets are exact multiples of it


def node(node_id: str, dram: int = 1024, disk: int = 0, alignment: int = 64) -> NodeInfo:
    return NodeInfo(node_id, {}, OffsetAllocator(dram, alignment), disk, 0.0)


def make(*nodes: NodeInfo) -> NodeSpace:
    """A NodeSpace over its own node dict and action list, as `StoreIndex` builds it."""
    return NodeSpace({n.node_id: n for n in nodes}, [])


def dram(space: NodeSpace, node_id: str) -> Replica:
    """A DRAM replica of one slot, allocated on `node_id` the way `Tiering` does."""
    offset = space.nodes[node_id].allocator.allocate(SLOT)
    return Replica(node_id, Tier.DRAM, offset, SLOT, space.new_version(), complete=True)


def used(space: NodeSpace, node_id: str) -> int:
    return space.nodes[node_id].allocator.used_bytes


# ---- versions and the fits check ------------------------------------------------------------
def test_versions_start_at_one_and_are_never_handed_out_twice() -> None:
    space = make(node("n0"))
    assert [space.new_version() for _ in range(4)] == [1, 2, 3, 4]
    replica = dram(space, "n0")
    space.free_range("k", replica)
    again = dram(space, "n0")
    assert (replica.offset, again.offset) == (0, 0)  # the same range is reused ...
    assert (replica.version, again.version) == (5, 6)  # ... under a new version
    assert make(node("n0")).new_version() == 1  # per space, not global


def test_check_fits_without_nodes_says_to_start_one() -> None:
    with pytest.raises(NoNodes) as info:
        make().check_fits(HEADER_BYTES + 1)
    assert str(info.value) == "no store node is registered: start `kvcake store node`"


def test_check_fits_compares_with_the_largest_segment_and_names_the_payload() -> None:
    space = make(node("small", dram=512), node("big", dram=1024))
    space.check_fits(1024)  # exactly the largest segment: fits
    with pytest.raises(InvalidRequest) as info:
        space.check_fits(1025)
    assert str(info.value) == (
        f"object of {1025 - HEADER_BYTES} bytes is larger than any segment (largest 1024 bytes, "
        f"{HEADER_BYTES} of them per-object header): split it or give a node more DRAM")
    assert (used(space, "small"), used(space, "big"), space.actions) == (0, 0, [])


def test_check_fits_sees_nodes_added_to_the_shared_dict() -> None:
    nodes: dict[str, NodeInfo] = {}
    actions: list[TierAction] = []
    space = NodeSpace(nodes, actions)
    with pytest.raises(NoNodes):
        space.check_fits(SLOT)
    nodes["n0"] = node("n0")  # the index registers into its own dict: never copied
    space.check_fits(SLOT)
    assert space.nodes is nodes and space.actions is actions


def test_check_fits_rejects_an_object_whose_aligned_size_no_segment_holds() -> None:
    space = make(node("n0", dram=1000))
    with pytest.raises(OutOfSpace):  # even the empty segment cannot hold it
        space.nodes["n0"].allocator.allocate(1000)
    with pytest.raises(InvalidRequest, match="larger than any segment"):
        space.check_fits(1000)


# ---- freeing at once ------------------------------------------------------------------------
def test_a_dram_range_without_readers_is_freed_at_once_and_queues_nothing() -> None:
    space = make(node("n0"))
    first, second = dram(space, "n0"), dram(space, "n0")
    space.free_range("a", first)
    assert space.nodes["n0"].allocator.free_ranges() == [(0, SLOT), (2 * SLOT, 1024 - 2 * SLOT)]
    assert (used(space, "n0"), space.actions) == (SLOT, [])
    space.free_range("b", second)
    assert space.nodes["n0"].allocator.free_ranges() == [(0, 1024)]


def test_a_disk_replica_returns_its_bytes_and_queues_drop_disk_even_under_a_lease() -> None:
    space = make(node("n0", disk=1024))
    space.nodes["n0"].disk_used_bytes = 3 * SLOT
    disk = Replica("n0", Tier.DISK, 0, SLOT, 7, complete=True)
    space.free_range("k", disk, release_s=50.0, readers=frozenset({1}))
    assert space.nodes["n0"].disk_used_bytes == 2 * SLOT  # readers read DRAM, never the disk
    assert space.actions == [TierAction(ActionKind.DROP_DISK, "n0", "k", disk_version=7)]
    assert used(space, "n0") == 0  # the DRAM segment is untouched
    space.release(1)
    space.expire(100.0)
    assert (space.nodes["n0"].disk_used_bytes, len(space.actions)) == (2 * SLOT, 1)


def test_a_replica_on_a_gone_node_frees_nothing_and_queues_nothing() -> None:
    space = make(node("n0", disk=1024))
    space.free_range("k", Replica("gone", Tier.DRAM, 0, SLOT, 1, complete=True))
    space.free_range("k", Replica("gone", Tier.DISK, 0, SLOT, 2, complete=True))
    space.free_range("k", Replica("gone", Tier.DRAM, 0, SLOT, 3), 9.0, frozenset({1}))
    space.release(1)
    space.expire(10.0)
    assert (space.actions, used(space, "n0"), space.nodes["n0"].disk_used_bytes) == ([], 0, 0)


# ---- freeing under read leases --------------------------------------------------------------
def test_a_leased_range_is_freed_when_its_last_reader_releases_not_before() -> None:
    space = make(node("n0"))
    replica = dram(space, "n0")
    space.free_range("a", replica, release_s=15.0, readers=frozenset({1, 2}))
    assert used(space, "n0") == SLOT
    space.release(1)
    space.release(3)  # not a reader of it
    assert used(space, "n0") == SLOT  # reader 2 may still be copying
    space.release(2)
    assert used(space, "n0") == 0
    space.release(2)  # twice: ignored
    space.expire(15.0)  # the deadline no longer frees it a second time (that would raise)
    assert (used(space, "n0"), space.actions) == (0, [])


def test_a_leased_range_is_freed_at_its_deadline_not_before() -> None:
    space = make(node("n0"))
    replica = dram(space, "n0")
    space.free_range("a", replica, release_s=15.0, readers=frozenset({1}))
    space.expire(14.999)
    assert used(space, "n0") == SLOT
    space.expire(15.0)  # release_s <= now_s
    assert used(space, "n0") == 0
    space.release(1)  # the reader finishing late frees nothing twice (that would raise)
    assert used(space, "n0") == 0


def test_a_deferred_range_without_readers_waits_for_its_deadline() -> None:
    space = make(node("n0"))
    space.free_range("a", dram(space, "n0"), release_s=5.0)
    space.release(1)
    assert used(space, "n0") == SLOT
    space.expire(5.0)
    assert used(space, "n0") == 0


def test_expire_frees_only_the_ranges_that_are_due() -> None:
    space = make(node("n0"))
    early, late = dram(space, "n0"), dram(space, "n0")
    space.free_range("b", late, release_s=20.0, readers=frozenset({2}))
    space.free_range("a", early, release_s=10.0, readers=frozenset({1}))
    space.expire(10.0)
    assert space.nodes["n0"].allocator.free_ranges() == [(0, SLOT), (2 * SLOT, 1024 - 2 * SLOT)]
    space.expire(20.0)
    assert used(space, "n0") == 0


def test_one_release_frees_every_range_it_was_the_last_reader_of() -> None:
    space = make(node("n0"), node("n1"))
    on_n0, on_n1, shared = dram(space, "n0"), dram(space, "n1"), dram(space, "n0")
    space.free_range("a", on_n0, 30.0, frozenset({1}))
    space.free_range("a", on_n1, 30.0, frozenset({1}))
    space.free_range("b", shared, 30.0, frozenset({1, 2}))
    space.release(1)
    assert (used(space, "n0"), used(space, "n1")) == (SLOT, 0)  # `shared` waits for reader 2
    assert space.nodes["n0"].allocator.free_ranges() == [(0, SLOT), (2 * SLOT, 1024 - 2 * SLOT)]
    space.release(2)
    assert used(space, "n0") == 0


def test_forget_node_drops_its_deferred_ranges_so_a_restarted_node_keeps_its_new_ones() -> None:
    space = make(node("n0"), node("n1"))
    old, other = dram(space, "n0"), dram(space, "n1")
    space.free_range("a", old, 10.0, frozenset({1}))
    space.free_range("b", other, 10.0, frozenset({1}))
    space.forget_node("n0")
    space.nodes["n0"] = node("n0")  # it registers again: a fresh segment
    fresh = dram(space, "n0")
    assert fresh.offset == old.offset == 0
    space.release(1)
    space.expire(10.0)
    assert (used(space, "n0"), used(space, "n1")) == (SLOT, 0)  # the new range survives


def test_a_deferred_range_whose_node_left_is_dropped_without_error() -> None:
    space = make(node("n0"), node("n1"))
    space.free_range("a", dram(space, "n0"), 10.0, frozenset({1}))
    space.free_range("b", dram(space, "n1"), 10.0, frozenset({2}))
    del space.nodes["n0"], space.nodes["n1"]
    space.release(1)  # its node is gone: nothing to free
    space.expire(10.0)
    assert space.actions == []
