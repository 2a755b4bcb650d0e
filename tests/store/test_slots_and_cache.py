"""Slot puts (writer.py) and the reader's location cache (reader.py).

A put through a reserved slot is one write and one master request; a get of a remembered key is
one read and no master request. What must still hold: a reader never sees a half-written object,
a writer that dies leaves nothing visible and its space comes back, a stale location never serves
wrong bytes, and every read is checked (a corrupted replica is detected).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import EmbeddedConfig, MasterConfig, NodeConfig
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.errors import InvalidRequest, ObjectNotFound, StoreError, TransferFailed
from kvcake.store.layout import HEADER_BYTES, payload_checksum
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.protocol import ONE_WAY_OPS
from kvcake.store.reader import CACHE_ENTRIES
from kvcake.store.replica_io import write_requests
from kvcake.transfer import TransferConfig, TransferError

PUT_TIMEOUT_S = 30.0
SEAL_WAIT_S = 0.05  # real seconds a get waits for a seal that never comes (the crash test)


class Counting:
    """A master that records which operations a client asks of it (and can fail one)."""

    def __init__(self, service: MasterService) -> None:
        self.service = service
        self.calls: list[str] = []
        self.fail_seals = False
        self.fail_commits = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.service, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "put_slots" and self.fail_commits and args and args[0]:
                raise StoreError("the writer died before its commit reached the master")
            if name == "put_seal" and self.fail_seals:
                raise StoreError("the writer died before its seal reached the master")
            return attr(*args, **kwargs)
        return call


def _store(clock: ManualClock, num_nodes: int = 1, dram: int = 1 << 20) -> EmbeddedStore:
    config = MasterConfig(put_timeout_s=PUT_TIMEOUT_S, lease_s=5.0, heartbeat_timeout_s=1e9,
                          seal_wait_s=SEAL_WAIT_S)
    return EmbeddedStore(EmbeddedConfig(dram, num_nodes=num_nodes, master=config),
                         clock=clock)


def _client(store: EmbeddedStore, clock: ManualClock, **kwargs: Any) -> tuple[StoreClient, Counting]:
    master = Counting(store.master)
    kwargs.setdefault("location_cache", CACHE_ENTRIES)  # off by default: these tests are of it
    return StoreClient(master, engine=store.engine, clock=clock, **kwargs), master


def _corrupt(store: EmbeddedStore, replica: dict[str, Any]) -> None:
    """Flip the first payload byte of one replica, at rest in its node's memory."""
    node = next(n for n in store.nodes if n.node_id == replica["node_id"])
    node._view()[replica["offset"] + HEADER_BYTES] ^= 0xFF


def test_a_slot_put_is_one_write_and_one_master_request_and_a_cached_get_none() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock)
        assert client.put("a", b"x" * 5000)  # the first put of a size reserves its slot first
        assert master.calls == ["put_slots", "put_slots"]
        master.calls.clear()
        assert client.put("b", b"y" * 5000)
        assert master.calls == ["put_slots"]  # commit of b + the next slot, one request
        assert store.master.index.objects["b"].committed  # acknowledged before put returned
        master.calls.clear()
        assert client.get("a") == b"x" * 5000 and client.get("b") == b"y" * 5000
        assert master.calls == ["touch", "touch"]  # no lookup, only the LRU news


def test_an_async_seal_put_names_writes_then_seals() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock, async_seal=True)
        assert client.put("a", b"x" * 5000)  # the first put of a size reserves its slot first
        assert master.calls == ["put_slots", "put_slots", "put_seal"]
        master.calls.clear()
        assert client.put("b", b"y" * 5000)
        assert master.calls == ["put_slots", "put_seal"]  # name b + the next slot; one-way seal
        master.calls.clear()
        assert client.get("a") == b"x" * 5000 and client.get("b") == b"y" * 5000
        assert master.calls == ["touch", "touch"]  # no lookup, only the LRU news
        assert store.master.exists("a") and store.master.exists("b")


@pytest.mark.parametrize("async_seal", [False, True])
def test_a_put_of_an_existing_key_returns_false_and_keeps_its_slot(async_seal: bool) -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, _ = _client(store, clock, async_seal=async_seal)
        other = store.client(location_cache=0)
        assert client.put("k", b"1" * 100)
        assert not client.put("k", b"2" * 100)  # written into the slot, never named k
        assert other.get("k") == b"1" * 100
        assert len(store.master.index.slots) == 1  # the same slot, ready for the next put
        assert client.put("j", b"3" * 100) and other.get("j") == b"3" * 100


def test_a_writer_that_dies_before_its_seal_leaves_nothing_and_its_space_comes_back() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock, async_seal=True)
        assert client.put("first", b"f" * 3000)
        used = store.master.stats()["used_bytes"]
        master.fail_seals = True
        with pytest.raises(StoreError, match="died"):  # named, bytes written, never sealed
            client.put("half", b"h" * 3000)
        reader = store.client(location_cache=0)
        assert not reader.exists("half")  # each waits SEAL_WAIT_S for the seal, then answers
        with pytest.raises(ObjectNotFound):
            reader.get("half")
        assert store.master.index.objects["half"].sealing  # named, pending, unreadable
        used_before_reclaim = store.master.stats()["used_bytes"]
        clock.advance(PUT_TIMEOUT_S + 1)
        store.master.tick()
        assert "half" not in store.master.index.objects
        client.release_slots()  # the next put's slot too: only "first" is left
        stats = store.master.stats()
        assert stats["used_bytes"] < used_before_reclaim
        assert stats["used_bytes"] == used and stats["slot_bytes"] == 0
        assert sum(n.allocator.used_bytes for n in store.master.index.nodes.values()) == used
        assert reader.get("first") == b"f" * 3000 and not reader.exists("half")


def test_an_acknowledged_put_that_dies_before_its_commit_leaves_nothing() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock)
        assert client.put("first", b"f" * 3000)
        stats = store.master.stats()
        used, held = stats["used_bytes"], stats["slot_bytes"]
        assert held > 0  # the slot for the next put of this size, not counted as used
        master.fail_commits = True
        with pytest.raises(StoreError, match="died"):  # bytes written into the slot
            client.put("half", b"h" * 3000)
        reader = store.client(location_cache=0)
        assert not reader.exists("half")
        with pytest.raises(ObjectNotFound):
            reader.get("half")
        assert store.master.index.slots  # the written slot: reserved, unnamed, unreadable
        clock.advance(PUT_TIMEOUT_S + 1)
        store.master.tick()
        assert not store.master.index.slots
        stats = store.master.stats()  # its range is free again
        assert stats["used_bytes"] == used and stats["slot_bytes"] == 0
        assert sum(n.allocator.used_bytes for n in store.master.index.nodes.values()) == used
        assert reader.get("first") == b"f" * 3000


@pytest.mark.parametrize("async_seal", [False, True])
def test_a_writer_whose_write_fails_leaves_nothing(async_seal: bool) -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, _ = _client(store, clock, async_seal=async_seal)
        assert client.put("first", b"f" * 3000)

        def broken(requests: Any, digests: Any = None) -> None:
            raise TransferError("the node went away mid-write")

        client._writer._transfer = broken
        with pytest.raises(TransferFailed, match="mid-write"):
            client.put("half", b"h" * 3000)
        assert "half" not in store.master.index.objects  # revoked (or never named) at once
        reader = store.client(location_cache=0)
        with pytest.raises(ObjectNotFound):
            reader.get("half")


def test_a_get_of_a_named_key_waits_for_its_seal_and_serves_the_sealed_bytes() -> None:
    clock = ManualClock(0.0)
    config = MasterConfig(seal_wait_s=30.0)  # never runs out here: the seal is sent below
    with EmbeddedStore(EmbeddedConfig(1 << 20, master=config), clock=clock) as store:
        writer = store.client()
        reader = store.client(location_cache=0)
        value = os.urandom(2000)
        checksum = payload_checksum(value)
        slot = store.master.put_slots([], [2000, 1, None, None])["slots"][0]
        named = store.master.put_slots([["k", slot["slot"], 2000, checksum]], None,
                                       seal_later=True)
        assert named["results"][0]["ok"]
        waiting = threading.Event()
        original = store.master._sealed.wait_for

        def wait_for(predicate: Any, timeout: float | None = None) -> bool:
            waiting.set()  # the reader is inside the master, waiting for the seal
            return original(predicate, timeout)

        store.master._sealed.wait_for = wait_for  # type: ignore[method-assign]
        got: list[bytes] = []
        thread = threading.Thread(target=lambda: got.append(reader.get("k")))
        thread.start()
        assert waiting.wait(10.0)
        writer._writer._transfer(write_requests(memoryview(value), checksum,
                                                slot["replicas"]))
        store.master.put_seal(["k"])
        thread.join(10.0)
        assert got == [value]


def test_a_slot_is_not_written_in_the_second_half_of_its_time() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock, async_seal=True)
        assert client.put("a", b"a" * 1000)
        (old,) = store.master.index.slots
        clock.advance(PUT_TIMEOUT_S / 2)
        master.calls.clear()
        assert client.put("b", b"b" * 1000)
        assert master.calls == ["release_slots", "put_slots", "put_slots", "put_seal"]
        assert old not in store.master.index.slots
        assert client.get("b") == b"b" * 1000


def test_a_stale_cached_location_never_serves_wrong_bytes() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock)
        other = store.client(location_cache=0)
        assert client.put("k", b"K" * 4000)
        offset = store.master.get("k")["replicas"][0]["offset"]
        other.remove("k")  # behind the back of client's cache
        clock.advance(10.0)  # past any lease: the range is free for reuse
        store.master.tick()
        other.release_slots()
        store.master.tick()
        assert other.put("z", b"Z" * 4000)  # first fit: the same range, a new version
        assert store.master.get("z")["replicas"][0]["offset"] == offset
        with pytest.raises(ObjectNotFound):  # the cached read fails its check, the master says
            client.get("k")
        assert other.put("k", b"N" * 4000)  # the key again, elsewhere: the new bytes
        assert client.get("k") == b"N" * 4000
        assert client.get_into("k", bytearray(4000)) == 4000


def test_the_clients_own_remove_forgets_the_location() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, _ = _client(store, clock)
        assert client.put("k", b"k" * 100)
        client.remove("k")  # the range is still intact (and unreused) after this
        with pytest.raises(ObjectNotFound):
            client.get("k")
        assert client.put("j", b"j" * 100)
        assert client.remove_batch(["j"]) == [True]
        with pytest.raises(ObjectNotFound):
            client.get("j")


def test_a_corrupted_replica_is_detected_through_a_cached_location() -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2) as store:
        client, _ = _client(store, clock, num_replicas=2)
        values = {k: os.urandom(6000) for k in "ab"}
        for key, value in values.items():
            assert client.put(key, value)
        replicas = store.master.get("a")["replicas"]
        assert len(replicas) == 2
        _corrupt(store, replicas[0])  # the cached one is the first replica
        assert client.get("a") == values["a"]  # detected, the other replica served
        for replica in store.master.get("b")["replicas"]:
            _corrupt(store, replica)
        with pytest.raises(TransferFailed, match="could be read intact"):
            client.get("b")
        with pytest.raises(TransferFailed):
            client.get_into("b", bytearray(6000))


@pytest.mark.parametrize("async_seal", [False, True])
def test_concurrent_slot_puts_and_cached_gets_serve_only_the_bytes_put(async_seal: bool) -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2, dram=4 << 20) as store:
        client, _ = _client(store, clock, async_seal=async_seal)
        errors: list[BaseException] = []

        def work(thread: int) -> None:
            try:
                for i in range(40):
                    key, value = f"t{thread}-{i}", bytes([thread, i]) * (512 + 16 * (i % 3))
                    assert client.put(key, value)
                    assert client.get(key) == value
                    if i % 5 == 0:
                        client.remove(key)
                        with pytest.raises(ObjectNotFound):
                            client.get(key)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        reader = store.client(location_cache=0)
        for t in range(4):
            for i in range(40):
                key = f"t{t}-{i}"
                if i % 5:
                    assert reader.get(key) == bytes([t, i]) * (512 + 16 * (i % 3))
                else:
                    assert not reader.exists(key)
        client.release_slots()
        store.master.tick()
        assert not store.master.index.slots


def test_put_slots_validates_its_arguments() -> None:
    service = MasterService(MasterConfig())
    with pytest.raises(InvalidRequest, match="commits"):
        service.put_slots([["k", 1, 2]])
    with pytest.raises(InvalidRequest, match="reserve"):
        service.put_slots([], ["big", 1, None, None])
    with pytest.raises(InvalidRequest, match="slots"):
        service.release_slots(["x"])
    with pytest.raises(InvalidRequest, match="keys"):
        service.touch([1])
    result = service.put_slots([["k", 7, 10, 1]], None)  # an unknown slot: that entry fails
    assert result["slots"] == [] and result["results"][0]["error"]["type"] == "ObjectNotFound"
    assert {"release_slots", "touch", "put_seal"} <= ONE_WAY_OPS
    with pytest.raises(InvalidRequest, match="keys"):
        service.put_seal([3])
    with pytest.raises(ObjectNotFound, match="seal"):
        service.put_seal(["never-named"])


def test_over_tcp_cached_reads_reach_the_masters_lru_before_the_next_request(
        master: MasterServer) -> None:
    node = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="n").start()
    config = TransferConfig(serve=False, use_shared_memory=False, num_rails=1)
    try:
        with StoreClient(master.address, transfer_config=config,
                         location_cache=CACHE_ENTRIES) as client:
            for key in "abc":
                assert client.put(key, key.encode() * 2000)
            lru = master.service.index.lru
            assert lru.oldest_first() == ["a", "b", "c"]
            assert client.get("a") == b"a" * 2000 and client.get("b") == b"b" * 2000
            client.exists("a")  # answered: the merged touch before it is handled
            assert lru.oldest_first() == ["c", "a", "b"]
    finally:
        node.close()


class NodeDiesBeforeCommit(Counting):
    """A master whose node holding the slot of the next commit leaves just before that commit
    reaches it (the bytes were written into the slot, then the node died)."""

    def __init__(self, service: MasterService) -> None:
        super().__init__(service)
        self.armed = False
        self.killed: str | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "put_slots" and self.armed:
            def commit(commits: list[Any], *args: Any, **kwargs: Any) -> Any:
                if commits and self.killed is None:
                    slot = self.service.index.slots[commits[0][1]]
                    self.killed = slot.replicas[0].node_id
                    self.service.unregister_node(self.killed)
                return self.service.put_slots(commits, *args, **kwargs)
            return commit
        return super().__getattr__(name)


@pytest.mark.parametrize("async_seal", [False, True])
def test_a_node_dying_between_allocate_and_commit_leaves_nothing_visible_or_leaked(
        async_seal: bool) -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2) as store:
        master = NodeDiesBeforeCommit(store.master)
        client = StoreClient(master, engine=store.engine, clock=clock, async_seal=async_seal,
                             location_cache=CACHE_ENTRIES)
        assert client.put("first", b"f" * 3000)  # reserves the slot the next put writes into
        master.armed = True
        assert client.put("second", b"s" * 3000)  # its slot's node died: put the ordinary way
        index = store.master.index
        assert master.killed is not None and master.killed not in index.nodes
        (survivor,) = index.nodes
        assert all(r.node_id == survivor for meta in index.objects.values()
                   for r in meta.replicas)
        assert all(r.node_id == survivor for meta in index.slots.values() for r in meta.replicas)
        reader = store.client(location_cache=0)
        assert reader.get("second") == b"s" * 3000
        client.release_slots()
        stats = store.master.stats()  # nothing leaked: what is used is exactly what is stored
        assert stats["slot_bytes"] == 0 and not index.slots
        align = store.master.config.alignment_bytes
        stored = sum(-(-r.alloc_bytes // align) * align for meta in index.objects.values()
                     for r in meta.replicas)
        assert stats["used_bytes"] == stored == index.nodes[survivor].allocator.used_bytes


def test_the_only_node_dying_between_allocate_and_commit_fails_the_put_and_leaves_nothing(
        ) -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        master = NodeDiesBeforeCommit(store.master)
        client = StoreClient(master, engine=store.engine, clock=clock)
        assert client.put("first", b"f" * 3000)
        master.armed = True
        with pytest.raises(StoreError, match="node"):  # no node left to put it on
            client.put("second", b"s" * 3000)
        assert not store.master.index.nodes and not store.master.index.objects
        assert not store.master.index.slots and store.master.stats()["used_bytes"] == 0
        with pytest.raises(ObjectNotFound):
            store.master.get("second")
