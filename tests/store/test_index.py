"""The master's pure metadata: exact eviction order, leases, pins, tiers, replicas, node death."""

from __future__ import annotations

import pytest

from kvcake.store.config import MasterConfig, Strategy
from kvcake.store.errors import InvalidRequest, NoNodes, NoSpace, ObjectExists, ObjectNotFound
from kvcake.store.index import ActionKind, StoreIndex, Tier
from kvcake.store.layout import HEADER_BYTES

OBJ = 256 - HEADER_BYTES  # one object fills exactly 256 aligned bytes


def make(num_nodes: int = 1, dram: int = 1024, disk: int = 0, **cfg: object) -> StoreIndex:
    config = MasterConfig(**{"high_watermark": 1.0, "low_watermark": 1.0, "heartbeat_timeout_s": 1e6, **cfg})  # type: ignore[arg-type]
    index = StoreIndex(config)
    for i in range(num_nodes):
        index.register_node(f"n{i}", dram, disk, {"segment": {"name": f"n{i}"}}, 0.0)
    return index


def put(index: StoreIndex, key: str, now_s: float = 0.0, replicas: int = 1,
        local: str | None = None) -> list[str]:
    placed = index.put_start(key, OBJ, 7, replicas, local, now_s)
    index.put_commit(key, now_s)
    return [r.node_id for r in placed]


def test_put_get_remove_round_trip() -> None:
    index = make()
    put(index, "a")
    meta = index.get("a", 1.0)
    assert (meta.size_bytes, meta.checksum, [r.offset for r in meta.dram()]) == (OBJ, 7, [0])
    assert index.exists("a")
    index.remove("a", 100.0)
    assert not index.exists("a")
    with pytest.raises(ObjectNotFound):
        index.get("a", 100.0)
    with pytest.raises(KeyError):  # ObjectNotFound is a KeyError
        index.remove("a", 100.0)


def test_lru_eviction_order_is_exact() -> None:
    index = make(dram=1024)  # four objects fit
    for key in "abcd":
        put(index, key)
    index.get("a", 100.0)  # a becomes the most recent; its lease ends at 105
    put(index, "e", now_s=200.0)  # needs one slot: b is the least recently used
    assert sorted(index.objects) == ["a", "c", "d", "e"]
    put(index, "f", now_s=200.0)
    assert sorted(index.objects) == ["a", "d", "e", "f"]
    assert index.num_evicted == 2


def test_watermarks_evict_down_to_low() -> None:
    index = make(dram=2048, high_watermark=0.9, low_watermark=0.5)  # 8 slots
    for i in range(7):
        put(index, f"k{i}")
    assert len(index.objects) == 7  # 7 * 256 = 1792 <= 0.9 * 2048
    put(index, "k7")  # 2048 > 1843: free down to 1024, i.e. evict k0..k3 (k7 is pending)
    assert sorted(index.objects) == ["k4", "k5", "k6", "k7"]


def test_a_lease_blocks_eviction_until_it_expires() -> None:
    index = make(dram=512, lease_s=5.0)
    put(index, "a")
    put(index, "b")
    index.get("a", 10.0)  # leased until 15
    index.get("b", 10.0)
    with pytest.raises(NoSpace):
        index.put_start("c", OBJ, 0, 1, None, 12.0)
    assert sorted(index.objects) == ["a", "b"]
    put(index, "c", now_s=15.0)  # leases over: a is the oldest access
    assert sorted(index.objects) == ["b", "c"]


def test_removed_while_leased_is_freed_only_after_the_lease() -> None:
    index = make(dram=512, lease_s=5.0)
    put(index, "a")
    index.get("a", 10.0)
    index.remove("a", 11.0)
    assert index.nodes["n0"].allocator.used_bytes == 256  # a reader may still be copying
    index.expire(14.0)
    assert index.nodes["n0"].allocator.used_bytes == 256
    index.expire(15.0)
    assert index.nodes["n0"].allocator.used_bytes == 0


def test_a_released_lease_ends_before_lease_s() -> None:
    index = make(dram=512, lease_s=5.0)
    put(index, "a")
    put(index, "b")
    _, first = index.get_leased("a", 10.0)
    _, second = index.get_leased("a", 10.0)  # two readers of a
    index.get("b", 10.0)  # b: leased, never released (runs out at 15)
    index.release("a", first)
    with pytest.raises(NoSpace):  # the second reader still holds a
        index.put_start("c", OBJ, 0, 1, None, 11.0)
    index.release("a", second)
    index.release("a", second)  # twice, or an unknown id: ignored
    index.release("gone", 12345)
    put(index, "c", now_s=11.0)  # a went at once, not at 15; b is still leased
    assert sorted(index.objects) == ["b", "c"]


def test_removed_while_leased_is_freed_when_its_readers_release() -> None:
    index = make(dram=512, lease_s=5.0)
    put(index, "a")
    _, lease_id = index.get_leased("a", 10.0)
    index.remove("a", 11.0)
    assert index.nodes["n0"].allocator.used_bytes == 256  # the reader may still be copying
    index.release("a", lease_id)
    assert index.nodes["n0"].allocator.used_bytes == 0


def test_a_full_disk_drops_its_own_lru_objects_to_take_a_demoted_one() -> None:
    index = make(dram=512, disk=512)  # two objects in DRAM, two on disk
    for key in "abcd":
        put(index, key, now_s=1.0)  # c evicts a, d evicts b: both demoted, the disk is full
    assert [index.objects[k].disk() != [] for k in "ab"] == [True, True]
    index.take_actions()
    put(index, "e", now_s=2.0)  # evicts c (DRAM LRU); to take it the disk drops a, its LRU
    assert "a" not in index.objects and index.num_disk_evicted == 1
    assert [r.tier for r in index.objects["c"].replicas] == [Tier.DISK]
    assert [r.tier for r in index.objects["b"].replicas] == [Tier.DISK]
    kinds = [(a.kind, a.key) for a in index.take_actions()]
    assert kinds == [(ActionKind.DROP_DISK, "a"), (ActionKind.DEMOTE, "c")]
    assert index.nodes["n0"].disk_used_bytes == 512
    index.get("b", 3.0)  # a read makes b the disk's most recent object; promoting b evicts d
    assert sorted(index.objects) == ["b", "d", "e"]  # and taking d drops c, not the older b
    assert index.num_disk_evicted == 2 and index.objects["d"].disk() != []


def test_a_disk_too_small_for_the_object_drops_nothing_of_it() -> None:
    index = make(dram=512, disk=256)
    for key in "abc":
        put(index, key, now_s=1.0)  # a demoted: the disk is full
    index.set_pin("a", True)  # a stays the disk's only object
    index.get("a", 20.0)  # a is leased (the promote needs DRAM: b goes, without a demote
    assert "b" not in index.objects  # since the only disk object, a, is leased)
    assert index.objects["a"].disk() != []


def test_soft_pins_go_last() -> None:
    index = make(dram=768)
    for key in "abc":
        put(index, key)
    index.set_pin("a", True)
    put(index, "d")
    assert sorted(index.objects) == ["a", "c", "d"]  # b went, not the older pinned a
    index.set_pin("c", True)
    index.set_pin("d", True)
    put(index, "e")  # everything is pinned: the oldest pinned goes
    assert sorted(index.objects) == ["c", "d", "e"]


def test_uncommitted_put_is_reclaimed_after_timeout() -> None:
    index = make(put_timeout_s=30.0)
    index.put_start("a", OBJ, 0, 1, None, 0.0)
    assert not index.exists("a")
    with pytest.raises(ObjectExists):
        index.put_start("a", OBJ, 0, 1, None, 1.0)
    index.expire(29.0)
    assert "a" in index.objects
    index.expire(30.0)
    assert "a" not in index.objects and index.nodes["n0"].allocator.used_bytes == 0
    with pytest.raises(ObjectNotFound, match="no put in progress"):
        index.put_commit("a", 31.0)


def test_demote_on_eviction_and_promote_on_hit() -> None:
    index = make(dram=512, disk=4096)
    put(index, "a")
    put(index, "b")
    put(index, "c")  # evicts a to disk
    (demote,) = index.take_actions()
    assert (demote.kind, demote.key, demote.offset) == (ActionKind.DEMOTE, "a", 0)
    meta = index.objects["a"]
    assert [r.tier for r in meta.replicas] == [Tier.DISK]
    assert index.nodes["n0"].disk_used_bytes == 256
    assert index.exists("a")

    assert index.get("a", 50.0).dram() == []  # needs a promote first: b (oldest) is demoted
    demote_b, promote = index.take_actions()
    assert (demote_b.kind, demote_b.key) == (ActionKind.DEMOTE, "b")
    assert (promote.kind, promote.key, promote.disk_version) == (
        ActionKind.PROMOTE, "a", demote.disk_version)
    index.promote_done("a", promote.version, True, 50.0)
    replicas = index.get("a", 50.0).dram()
    assert [(r.offset, r.version) for r in replicas] == [(promote.offset, promote.version)]
    # a keeps its disk copy: a second eviction needs no new demote.
    index.remove("a", 100.0)
    (drop,) = index.take_actions()
    assert (drop.kind, drop.disk_version) == (ActionKind.DROP_DISK, demote.disk_version)


def test_num_demoted_counts_the_demotes_the_nodes_carried_out() -> None:
    index = make(dram=512, disk=4096)
    for key in "abcd":
        put(index, key)  # c evicts a, d evicts b: two demotes planned
    demote_a, demote_b = index.take_actions()
    assert (demote_a.key, demote_b.key) == ("a", "b") and index.num_demoted == 0
    index.demote_done("a", demote_a.disk_version, True)
    index.demote_done("b", demote_b.disk_version, False)  # the node could not write it
    assert index.num_demoted == 1 and index.stats()["num_demoted"] == 1
    assert "b" not in index.objects and index.nodes["n0"].disk_used_bytes == 256


def test_no_disk_means_eviction_drops() -> None:
    index = make(dram=256)
    put(index, "a")
    put(index, "b")
    assert index.take_actions() == [] and not index.exists("a")


def test_replicas_on_distinct_nodes_and_node_death() -> None:
    index = make(num_nodes=3)
    assert sorted(put(index, "a", replicas=2)) == ["n0", "n1"]
    assert sorted(put(index, "b", replicas=5)) == ["n0", "n1", "n2"]  # at most one per node
    put(index, "c", local="n2", replicas=1)  # most-free-first: n2 has the most room
    lost = index.remove_node("n0")
    assert lost == []
    assert [r.node_id for r in index.get("a", 0.0).dram()] == ["n1"]
    assert index.remove_node("n1") == ["a"]
    assert not index.exists("a") and index.exists("b") and index.exists("c")


def test_heartbeat_timeout_declares_a_node_dead() -> None:
    index = make(num_nodes=2, heartbeat_timeout_s=10.0)
    put(index, "a", replicas=1)
    index.heartbeat("n1", 8.0)
    assert index.expire(10.0) == []
    assert index.expire(10.5) == ["n0"]
    assert not index.exists("a")
    assert not index.heartbeat("n0", 11.0)  # it must register again


def test_change_replica_up_and_down() -> None:
    index = make(num_nodes=3)
    put(index, "a", replicas=1)
    new = index.add_replicas("a", 3, 0.0)
    assert sorted(r.node_id for r in new) == ["n1", "n2"]
    assert len(index.get("a", 0.0).dram()) == 1  # pending until the copies are done
    index.replicas_done("a", [r.version for r in new], True, 0.0)
    assert len(index.get("a", 0.0).dram()) == 3
    assert index.drop_replicas("a", 1, 100.0) == 2
    assert len(index.get("a", 100.0).dram()) == 1


def test_strategies() -> None:
    local = make(num_nodes=3, strategy=Strategy.LOCAL_FIRST)
    assert put(local, "a", local="n2") == ["n2"]
    assert put(local, "b", local="n2") == ["n2"]
    spread = make(num_nodes=3, strategy=Strategy.MOST_FREE_FIRST)
    assert [put(spread, k)[0] for k in "abc"] == ["n0", "n1", "n2"]
    rand1 = make(num_nodes=3, strategy=Strategy.RANDOM, seed=3)
    rand2 = make(num_nodes=3, strategy=Strategy.RANDOM, seed=3)
    assert [put(rand1, k)[0] for k in "abcdef"] == [put(rand2, k)[0] for k in "abcdef"]


def test_versions_are_never_reused() -> None:
    index = make(dram=256)
    versions = set()
    for i in range(10):
        index.put_start(f"k{i}", OBJ, 0, 1, None, 0.0)
        index.put_commit(f"k{i}", 0.0)
        (replica,) = index.objects[f"k{i}"].replicas
        assert replica.offset == 0  # the same range every time ...
        versions.add(replica.version)
    assert len(versions) == 10  # ... but never the same version


def test_bad_input_is_rejected_and_the_index_keeps_working() -> None:
    empty = StoreIndex(MasterConfig())
    with pytest.raises(NoNodes, match="kvcake store node"):
        empty.put_start("a", 1, 0, 1, None, 0.0)
    index = make(dram=1024)
    with pytest.raises(InvalidRequest, match="key"):
        index.put_start("", 1, 0, 1, None, 0.0)
    with pytest.raises(InvalidRequest, match="larger than any segment"):
        index.put_start("big", 1024, 0, 1, None, 0.0)
    with pytest.raises(InvalidRequest, match="size_bytes"):
        index.put_start("neg", -1, 0, 1, None, 0.0)
    with pytest.raises(InvalidRequest, match="num_replicas"):
        index.drop_replicas("x", 0, 0.0)
    put(index, "ok")
    assert index.exists("ok") and index.nodes["n0"].allocator.used_bytes == 256


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="watermark"):
        MasterConfig(high_watermark=0.5, low_watermark=0.8)
    with pytest.raises(ValueError, match="unknown keys"):
        MasterConfig.from_dict({"lease": 1})
    with pytest.raises(ValueError, match="strategy|'fastest'"):
        MasterConfig(strategy="fastest")  # type: ignore[arg-type]
    assert MasterConfig.from_dict({"strategy": "random"}).strategy is Strategy.RANDOM


def test_dropped_replicas_are_freed_at_once_when_no_reader_holds_them() -> None:
    index = make(num_nodes=3, lease_s=5.0)
    put(index, "a", replicas=3)
    assert index.stats()["used_bytes"] == 3 * 256
    assert index.drop_replicas("a", 1, 1.0) == 2
    assert index.stats()["used_bytes"] == 256  # not held back by a lease of its own


def test_dropped_replicas_under_a_read_lease_are_freed_when_it_is_released() -> None:
    index = make(num_nodes=3, lease_s=5.0)
    put(index, "a", replicas=3)
    _, lease_id = index.get_leased("a", 1.0)
    assert index.drop_replicas("a", 1, 1.0) == 2
    assert index.stats()["used_bytes"] == 3 * 256  # a reader may still be reading them
    index.release("a", lease_id)
    assert index.stats()["used_bytes"] == 256


def test_add_replicas_takes_no_lease() -> None:
    index = make(num_nodes=3, lease_s=5.0)
    put(index, "a", replicas=1)
    index.add_replicas("a", 2, 1.0)
    assert index.objects["a"].leases == {}


def test_a_get_forgets_the_leases_that_ended_and_keeps_the_running_ones() -> None:
    index = make(dram=512, lease_s=5.0)
    put(index, "a", now_s=0.0)
    ids = [index.get_leased("a", t)[1] for t in (1.0, 2.0, 3.0)]  # end at 6, 7, 8
    _, latest = index.get_leased("a", 7.0)  # the leases ending at 6 and 7 are over
    assert index.objects["a"].leases == {ids[2]: 8.0, latest: 12.0}
    index.release("a", ids[2])
    assert index.objects["a"].leases == {latest: 12.0}
