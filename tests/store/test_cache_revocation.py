"""The location cache on by default, made safe by revocation (layout.revoke, master.py).

A client that remembered where an object lives reads it without asking the master. These tests
pin that such a read is linearizable with what other clients and the master do: once a remove,
an eviction, an overwrite or a node's departure is acknowledged, no remembered location serves
the dropped object, even while its bytes are still intact in the node's memory (the case a
version check alone cannot catch). Clocks are manual; nothing sleeps.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import EmbeddedConfig, MasterConfig, NodeConfig
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.errors import ObjectNotFound
from kvcake.store.layout import (
    HEADER_BYTES,
    CorruptObject,
    RevokedObject,
    is_revoked,
    pack_header,
    payload_checksum,
    revoke,
    verify,
)
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.transfer import TransferConfig

TCP = TransferConfig(serve=False, use_shared_memory=False, num_rails=1)


def _store(clock: ManualClock, num_nodes: int = 1, dram: int = 1 << 20) -> EmbeddedStore:
    config = MasterConfig(put_timeout_s=30.0, lease_s=5.0, heartbeat_timeout_s=10.0)
    return EmbeddedStore(EmbeddedConfig(dram, num_nodes=num_nodes, master=config), clock=clock)


class Counting:
    """A master that records the operations a client asks of it."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.service, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)
        return call


def _header_at(store: EmbeddedStore, replica: dict[str, Any]) -> bytes:
    node = next(n for n in store.nodes if n.node_id == replica["node_id"])
    return bytes(node._view()[replica["offset"]:replica["offset"] + HEADER_BYTES])


def test_revoke_marks_only_the_named_version_and_a_live_read_refuses_it() -> None:
    payload = b"p" * 100
    segment = memoryview(bytearray(4096))
    segment[0:HEADER_BYTES] = pack_header(payload_checksum(payload), 7, len(payload))
    segment[HEADER_BYTES:HEADER_BYTES + 100] = payload
    assert not revoke(segment, 0, 8)  # another version: a reused range is left alone
    assert not revoke(segment, 4000, 7)  # no header there (and past the end is refused)
    assert not is_revoked(segment[:HEADER_BYTES])
    verify(segment[:HEADER_BYTES], segment[HEADER_BYTES:HEADER_BYTES + 100], 7,
           payload_checksum(payload), live=True)
    assert revoke(segment, 0, 7)
    assert is_revoked(segment[:HEADER_BYTES])
    with pytest.raises(RevokedObject):
        verify(segment[:HEADER_BYTES], segment[HEADER_BYTES:HEADER_BYTES + 100], 7,
               payload_checksum(payload), live=True)
    # a read under a lease ignores the flag (its range is not reused while the lease runs)
    verify(segment[:HEADER_BYTES], segment[HEADER_BYTES:HEADER_BYTES + 100], 7,
           payload_checksum(payload))
    assert issubclass(RevokedObject, CorruptObject)


def test_the_cache_is_on_by_default_and_a_remembered_get_asks_the_master_nothing() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        master = Counting(store.master)
        client = StoreClient(master, engine=store.engine, clock=clock)
        assert client.put("k", b"v" * 3000)
        assert all(r["revocable"] for r in store.master.get("k")["replicas"])
        master.calls.clear()
        assert client.get("k") == b"v" * 3000
        assert client.get_into("k", bytearray(3000)) == 3000
        assert master.calls == ["touch", "touch"]  # no lookup: read from the remembered place


def test_another_clients_remove_is_seen_at_once_though_the_bytes_are_intact() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        reader, other = store.client(), store.client()
        assert reader.put("k", b"K" * 4000)
        assert reader.get("k") == b"K" * 4000  # remembered
        replica = store.master.get("k")["replicas"][0]
        other.remove("k")  # acknowledged: the node has revoked the replica
        header = _header_at(store, replica)
        assert is_revoked(header)  # the bytes are still there, unreused, but marked
        with pytest.raises(ObjectNotFound):
            reader.get("k")
        with pytest.raises(ObjectNotFound):
            reader.get_into("k", bytearray(4000))


def test_an_overwrite_by_another_client_serves_the_new_bytes() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        reader, writer = store.client(), store.client()
        assert writer.put("k", b"1" * 2000)
        assert reader.get("k") == b"1" * 2000  # remembered from a read through the master
        writer.remove("k")
        assert writer.put("k", b"2" * 2000)  # the key again, with other bytes
        assert reader.get("k") == b"2" * 2000
        assert reader.get_into("k", bytearray(2000)) == 2000


def test_an_evicted_object_is_not_served_before_its_range_is_written_again() -> None:
    clock = ManualClock(0.0)
    with _store(clock, dram=1 << 20) as store:
        reader = store.client()
        assert reader.put("a", b"a" * (300 << 10))
        reader.release_slots()  # only "a" in the segment
        # A put that needs room evicts "a"; its writer has not written yet: a's bytes are intact.
        replicas = store.master.put_start("big", 800 << 10, None)
        assert "a" not in store.master.index.objects and store.master.index.num_evicted == 1
        assert replicas[0]["offset"] == 0  # a's range, handed out, not yet written
        with pytest.raises(ObjectNotFound):
            reader.get("a")


def test_a_node_leaving_revokes_what_it_held() -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2) as store:
        reader = store.client(num_replicas=1)
        assert reader.put("k", b"k" * 1000)
        node_id = store.master.get("k")["replicas"][0]["node_id"]
        assert store.master.unregister_node(node_id) == ["k"]  # its segment is still mapped
        with pytest.raises(ObjectNotFound):
            reader.get("k")


def test_a_dropped_extra_replica_is_revoked_and_the_kept_one_serves() -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2) as store:
        reader, other = store.client(num_replicas=2), store.client()
        assert reader.put("k", b"r" * 1000)
        replicas = store.master.get("k")["replicas"]
        assert len(replicas) == 2
        assert other.change_replica("k", 1) == 1  # the second replica is dropped
        assert is_revoked(_header_at(store, replicas[1]))
        assert not is_revoked(_header_at(store, replicas[0]))
        assert reader.get("k") == b"r" * 1000


def test_a_read_under_a_lease_finishes_after_a_remove() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        client, other = store.client(location_cache=0), store.client()
        assert client.put("k", b"L" * 1000)
        meta = store.master.get("k")  # a lease, as a get in progress holds
        other.remove("k")
        buffer = bytearray(1000)
        assert client._read("k", meta, memoryview(buffer)) == 1000 and buffer == b"L" * 1000


def test_a_replica_the_master_cannot_revoke_is_never_remembered() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        del store.master._handles["node-0"]  # as a node registered without a control port
        master = Counting(store.master)
        client = StoreClient(master, engine=store.engine, clock=clock)
        assert client.put("k", b"n" * 1000)
        assert not store.master.get("k")["replicas"][0]["revocable"]
        master.calls.clear()
        assert client.get("k") == b"n" * 1000
        assert client.get("k") == b"n" * 1000
        assert master.calls.count("get") == 2  # asked every time


def test_a_revoked_location_found_through_the_master_is_not_remembered() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        writer = store.client()
        assert writer.put("k", b"x" * 1000)
        meta = store.master.get("k")
        replica = meta["replicas"][0]
        node = store.nodes[0]
        assert node.revoke([[replica["offset"], replica["version"]]]) == 1
        master = Counting(store.master)
        reader = StoreClient(master, engine=store.engine, clock=clock)
        assert reader.get("k") == b"x" * 1000  # through the master (a leased read)
        assert reader.get("k") == b"x" * 1000
        assert master.calls.count("get") == 2  # not remembered: it would only fail later


def test_over_tcp_a_remove_and_a_dead_node_revoke_through_the_control_port(
        master: MasterServer, clock: ManualClock) -> None:
    nodes = [StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                       node_id=f"n{i}").start() for i in range(2)]
    try:
        with StoreClient(master.address, transfer_config=TCP, num_replicas=1) as reader, \
                StoreClient(master.address, transfer_config=TCP) as other:
            for key in ("a", "b"):
                assert reader.put(key, key.encode() * 5000)
                assert reader.get(key) == key.encode() * 5000
            other.remove("a")
            with pytest.raises(ObjectNotFound):
                reader.get("a")
            # n-th node silent past heartbeat_timeout_s (its process still serves its segment)
            holder = master.service.get("b")["replicas"][0]["node_id"]
            for node in nodes:
                if node.node_id != holder:
                    master.service.heartbeat(node.node_id)
            clock.advance(11.0)
            for node in nodes:
                if node.node_id != holder:
                    master.service.heartbeat(node.node_id)
            assert master.service.tick() == [holder]
            with pytest.raises(ObjectNotFound):
                reader.get("b")
    finally:
        for node in nodes:
            node.close()


@pytest.mark.parametrize("adopted", [True, False])
def test_a_node_registering_again_keeps_what_is_adopted_and_revokes_the_rest(
        adopted: bool) -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        reader = store.client()
        assert reader.put("a", b"a" * 1000)
        meta = store.master.get("a")
        replica = meta["replicas"][0]
        entry = ["a", replica["offset"], replica["alloc_bytes"], replica["version"], 1000,
                 meta["checksum"]]
        node = store.nodes[0]
        endpoint = store.master.index.nodes["node-0"].endpoint
        store.master.register_node("node-0", 1 << 20, 0, endpoint, handle=node,
                                   objects=[entry] if adopted else [])
        if adopted:  # the same object, same version: still served from where it was
            assert not is_revoked(_header_at(store, replica))
            assert reader.get("a") == b"a" * 1000
        else:  # forgotten by the master: no remembered location may serve it
            assert is_revoked(_header_at(store, replica))
            with pytest.raises(ObjectNotFound):
                reader.get("a")


def test_with_a_cluster_secret_the_revoke_is_admitted_on_the_control_port() -> None:
    from kvcake.auth import ClusterSecret

    secret = ClusterSecret.from_text("revoke-cluster-secret-0123456789abcdef")
    service = MasterService(MasterConfig(heartbeat_timeout_s=1e9, lease_s=5.0), ManualClock(0.0))
    master = MasterServer(service, "127.0.0.1", 0, tick_interval_s=None, secret=secret).start()
    node = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="n0", secret=secret).start()
    config = TransferConfig(serve=False, use_shared_memory=False, num_rails=1, secret=secret)
    try:
        with StoreClient(master.address, transfer_config=config) as reader, \
                StoreClient(master.address, transfer_config=config) as other:
            assert reader.put("k", b"s" * 3000)
            replica = service.get("k")["replicas"][0]
            other.remove("k")
            header = bytes(node._view()[replica["offset"]:replica["offset"] + HEADER_BYTES])
            assert is_revoked(header)  # the master's revoke connection proved the secret
            with pytest.raises(ObjectNotFound):
                reader.get("k")
    finally:
        node.close()
        master.close()


def test_batch_gets_of_remembered_keys_ask_the_master_nothing_and_see_removes() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        master = Counting(store.master)
        reader = StoreClient(master, engine=store.engine, clock=clock)
        other = store.client()
        values = {k: k.encode() * 700 for k in ("a", "b", "c")}
        for key, value in values.items():
            assert reader.put(key, value)
        assert other.put("d", b"d" * 700)  # stored, not remembered by reader
        master.calls.clear()
        assert reader.get_batch(["a", "b", "c"]) == [values["a"], values["b"], values["c"]]
        buffers = [bytearray(700) for _ in range(3)]
        assert reader.get_batch_into(["c", "a", "b"], buffers) == [700, 700, 700]
        assert buffers == [values["c"], values["a"], values["b"]]
        assert master.calls == ["touch", "touch"]  # one merged LRU note per batch, no lookup
        other.remove("b")  # revoked at the node before the remove returned
        other.remove("c")
        assert other.put("c", b"C" * 700)  # the key again, other bytes
        master.calls.clear()
        assert reader.get_batch(["a", "b", "c", "d", "zz"]) == [
            values["a"], None, b"C" * 700, b"d" * 700, None]
        assert master.calls.count("get_batch") == 1  # only for b, c, d, zz
        buffers = [bytearray(700) for _ in range(4)]
        assert reader.get_batch_into(["b", "a", "d", "c"], buffers) == [None, 700, 700, 700]
        assert buffers[1:] == [values["a"], b"d" * 700, b"C" * 700]


def test_a_corrupted_remembered_replica_in_a_batch_goes_to_the_master() -> None:
    clock = ManualClock(0.0)
    with _store(clock, num_nodes=2) as store:
        reader = store.client(num_replicas=2)
        values = {k: k.encode() * 900 for k in ("a", "b")}
        for key, value in values.items():
            assert reader.put(key, value)
        for replica in store.master.get("a")["replicas"][:1]:  # the remembered one
            assert reader._reader._locations.entries["a"].offset == replica["offset"]
            node = next(n for n in store.nodes if n.node_id == replica["node_id"])
            node._view()[replica["offset"] + HEADER_BYTES] ^= 0xFF
        assert reader.get_batch(["a", "b"]) == [values["a"], values["b"]]
        buffers = [bytearray(900), bytearray(900)]
        assert reader.get_batch_into(["a", "b"], buffers) == [900, 900]
        assert buffers == [values["a"], values["b"]]


def test_a_node_whose_revoke_fails_is_no_longer_described_as_revocable() -> None:
    clock = ManualClock(0.0)
    with _store(clock) as store:
        node = store.nodes[0]
        calls: list[int] = []

        def failing(entries: list[list[int]]) -> int:
            calls.append(len(entries))
            raise OSError("control port unreachable")

        client = store.client()
        assert client.put("a", b"a" * 500) and client.put("b", b"b" * 500)
        node.revoke = failing  # type: ignore[method-assign]
        client.remove("a")  # answered anyway; the failure is logged
        assert calls == [1]
        assert not store.master.get("b")["replicas"][0]["revocable"]
        client.remove("b")
        assert calls == [1]  # not asked again (no wait on a node that cannot answer)
        del node.revoke  # the node registers again: revocable once more
        store.master.register_node("node-0", 1 << 20, 0,
                                   store.master.index.nodes["node-0"].endpoint, handle=node)
        assert client.put("c", b"c" * 500)
        assert store.master.get("c")["replicas"][0]["revocable"]
