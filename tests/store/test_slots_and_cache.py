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
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.master import MasterServer, MasterService
from kvcake.store.node import StoreNode
from kvcake.store.protocol import ONE_WAY_OPS
from kvcake.transfer import TransferConfig

PUT_TIMEOUT_S = 30.0


class Counting:
    """A master that records which operations a client asks of it (and can fail one)."""

    def __init__(self, service: MasterService) -> None:
        self.service = service
        self.calls: list[str] = []
        self.fail_commits = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.service, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "put_slots" and self.fail_commits and args and args[0]:
                raise StoreError("the writer died before its commit reached the master")
            return attr(*args, **kwargs)
        return call


def _store(clock: ManualClock, num_nodes: int = 1, dram: int = 1 << 20) -> EmbeddedStore:
    config = MasterConfig(put_timeout_s=PUT_TIMEOUT_S, lease_s=5.0, heartbeat_timeout_s=1e9)
    return EmbeddedStore(EmbeddedConfig(dram, num_nodes=num_nodes, master=config),
                         clock=clock)


def _client(store: EmbeddedStore, clock: ManualClock, **kwargs: Any) -> tuple[StoreClient, Counting]:
    master = Counting(store.master)
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
        master.calls.clear()
        assert client.get("a") == b"x" * 5000 and client.get("b") == b"y" * 5000
        assert master.calls == ["touch", "touch"]  # no lookup, only the LRU news
        assert store.master.exists("a") and store.master.exists("b")


def test_a_put_of_an_existing_key_returns_false_and_keeps_its_slot() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, _ = _client(store, clock)
        other = store.client(location_cache=0)
        assert client.put("k", b"1" * 100)
        assert not client.put("k", b"2" * 100)  # written into the slot, never named k
        assert other.get("k") == b"1" * 100
        assert len(store.master.index.slots) == 1  # the same slot, ready for the next put
        assert client.put("j", b"3" * 100) and other.get("j") == b"3" * 100


def test_a_writer_that_dies_before_its_commit_leaves_nothing_and_its_space_comes_back() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock)
        assert client.put("first", b"f" * 3000)
        used = store.master.stats()["used_bytes"]
        master.fail_commits = True
        with pytest.raises(StoreError, match="died"):  # bytes written into the slot, no commit
            client.put("half", b"h" * 3000)
        reader = store.client(location_cache=0)
        assert not reader.exists("half")
        with pytest.raises(ObjectNotFound):
            reader.get("half")
        assert store.master.index.slots  # the written slot, still reserved, still unnamed
        clock.advance(PUT_TIMEOUT_S + 1)
        store.master.tick()
        assert not store.master.index.slots
        assert store.master.stats()["used_bytes"] < used  # the slot's range is free again
        assert reader.get("first") == b"f" * 3000 and not reader.exists("half")


def test_a_slot_is_not_written_in_the_second_half_of_its_time() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, master = _client(store, clock)
        assert client.put("a", b"a" * 1000)
        (old,) = store.master.index.slots
        clock.advance(PUT_TIMEOUT_S / 2)
        master.calls.clear()
        assert client.put("b", b"b" * 1000)
        assert master.calls == ["release_slots", "put_slots", "put_slots"]  # a fresh slot
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


def test_concurrent_slot_puts_and_cached_gets_serve_only_the_bytes_put() -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2, dram=4 << 20) as store:
        client, _ = _client(store, clock)
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
    assert {"release_slots", "touch"} <= ONE_WAY_OPS


def test_over_tcp_cached_reads_reach_the_masters_lru_before_the_next_request(
        master: MasterServer) -> None:
    node = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="n").start()
    config = TransferConfig(serve=False, use_shared_memory=False, num_rails=1)
    try:
        with StoreClient(master.address, transfer_config=config) as client:
            for key in "abc":
                assert client.put(key, key.encode() * 2000)
            lru = master.service.index.lru
            assert lru.oldest_first() == ["a", "b", "c"]
            assert client.get("a") == b"a" * 2000 and client.get("b") == b"b" * 2000
            client.exists("a")  # answered: the merged touch before it is handled
            assert lru.oldest_first() == ["c", "a", "b"]
    finally:
        node.close()
