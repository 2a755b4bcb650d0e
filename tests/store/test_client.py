"""The client against a real master and real nodes: TCP control, transfer-engine data."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import EmbeddedConfig, MasterConfig, NodeConfig
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.errors import InvalidRequest, NoSpace, ObjectNotFound
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.transfer import TransferConfig

TCP = TransferConfig(serve=False, use_shared_memory=False, num_rails=2)


@pytest.fixture
def cluster(master: MasterServer) -> Iterator[tuple[MasterServer, list[StoreNode]]]:
    nodes = [StoreNode(NodeConfig(4 << 20, heartbeat_interval_s=3600), master.address,
                       node_id=f"n{i}", transfer_config=TransferConfig(num_rails=2)).start()
             for i in range(2)]
    yield master, nodes
    for node in nodes:
        node.close()


def test_put_get_over_tcp(cluster: tuple[MasterServer, list[StoreNode]]) -> None:
    master, _ = cluster
    with StoreClient(master.address, transfer_config=TCP) as client:
        data = os.urandom(1_500_000)  # more than one 1 MiB slice
        assert client.put("k", data) is True
        assert client.put("k", b"other") is False  # first write wins: keys name content
        assert client.get("k") == data
        buffer = np.zeros(2_000_000, np.uint8)
        assert client.get_into("k", buffer) == len(data)
        assert buffer[: len(data)].tobytes() == data
        assert client.put("empty", b"") and client.get("empty") == b""
        assert client.exists("k") and not client.exists("nope")
        client.remove("k")
        assert not client.exists("k")
        with pytest.raises(KeyError):
            client.get("k")


def test_batches(cluster: tuple[MasterServer, list[StoreNode]]) -> None:
    master, _ = cluster
    with StoreClient(master.address, transfer_config=TCP) as client:
        values = [os.urandom(10_000 + i) for i in range(8)]
        keys = [f"b{i}" for i in range(8)]
        assert client.put_batch(keys, values) == [True] * 8
        buffers = [bytearray(20_000) for _ in range(9)]
        sizes = client.get_batch_into([*keys, "missing"], buffers)
        assert sizes == [len(v) for v in values] + [None]
        assert all(bytes(b[: len(v)]) == v for b, v in zip(buffers, values, strict=False))
        got = client.get_batch(["missing", *keys, "missing"])  # new objects, in key order
        assert got == [None, *values, None] and all(type(g) is bytes for g in got[1:-1])
        assert client.get_batch(["b2", "b1"]) == [values[2], values[1]]  # reused scratch
        assert client.get_batch([]) == []
        assert client.exists_batch(["b0", "x"]) == [True, False]
        assert client.remove_batch(["b0", "x"]) == [True, False]
        with pytest.raises(InvalidRequest, match="3 keys but 2"):
            client.put_batch(["a", "b", "c"], [b"", b""])


def test_replicas_live_on_distinct_nodes_and_change(
        cluster: tuple[MasterServer, list[StoreNode]]) -> None:
    master, _ = cluster
    with StoreClient(master.address, transfer_config=TCP, num_replicas=2) as client:
        data = os.urandom(50_000)
        client.put("r", data)
        assert sorted(d["node_id"] for d in client.master.get("r")["replicas"]) == ["n0", "n1"]
        assert client.change_replica("r", 1) == 1
        assert len(client.master.get("r")["replicas"]) == 1
        held = set(master.service.index.objects["r"].leases)  # the raw master.get calls above
        assert client.change_replica("r", 2) == 2  # copied by the client from the survivor
        client.exists("r")  # a round trip after the one-way lease releases
        assert set(master.service.index.objects["r"].leases) == held  # it released what it took
        replicas = client.master.get("r")["replicas"]
        assert sorted(d["node_id"] for d in replicas) == ["n0", "n1"]
        assert client.get("r") == data


def test_tensors_round_trip() -> None:
    with StoreClient.embedded(1 << 20) as client:
        tensor = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
        client.put_tensor("t", tensor)
        back = client.get_tensor("t")
        assert back.dtype == torch.bfloat16 and torch.equal(back, tensor)
        raw = torch.randn(64, 8)
        client.put("raw", raw)  # a tensor is a buffer too
        out = torch.empty(64, 8)
        assert client.get_into("raw", out) == raw.numel() * 4 and torch.equal(out, raw)
        client.put("notatensor", b"\xff\xff\xff\xff")
        with pytest.raises(InvalidRequest, match="put_tensor"):
            client.get_tensor("notatensor")


def test_bad_input_leaves_the_store_serving() -> None:
    with StoreClient.embedded(1 << 20) as client:
        client.put("ok", b"fine")
        with pytest.raises(InvalidRequest, match="key"):
            client.put("", b"x")
        with pytest.raises(InvalidRequest, match="larger than any segment"):
            client.put("huge", bytes(2 << 20))
        with pytest.raises(ValueError, match="not a buffer"):
            client.put("bad", 12345)
        with pytest.raises(InvalidRequest, match="cannot hold"):
            client.get_into("ok", bytearray(2))
        with pytest.raises(ValueError, match="writable"):
            client.get_into("ok", b"immutable")
        assert client.get("ok") == b"fine"
        assert client.stats()["num_objects"] == 1


def test_a_failed_put_batch_leaves_nothing_pending() -> None:
    with StoreClient.embedded(1 << 20) as client:
        with pytest.raises(InvalidRequest, match="larger than any segment"):
            client.put_batch(["small", "huge", "other"], [b"s", bytes(2 << 20), b"o"])
        assert client.stats()["used_bytes"] == 0  # the batch's allocations were revoked
        assert client.put("small", b"s") is True and client.get("small") == b"s"


def test_a_lease_blocks_eviction_during_the_read_and_ends_with_it() -> None:
    clock = ManualClock(0.0)
    config = MasterConfig(lease_s=5.0, heartbeat_timeout_s=1e9)
    with EmbeddedStore(EmbeddedConfig(1 << 20, master=config), clock=clock) as store:
        client = store.client()
        half = bytes(400_000)
        client.put("a", half)
        client.put("b", half)
        client.pin("b")  # b goes last: only a's lease can make eviction take it
        reading = store.master.get("a")  # a reader holds a's lease (what get() does first)
        client.put("c", half)  # during that read: a, older and unpinned, is still kept
        assert client.exists("a") and not client.exists("b") and client.exists("c")
        store.master.release_leases([["a", reading["lease_id"]]])  # the read is over
        client.put("d", half)  # no time passed: a goes now, not after lease_s
        assert not client.exists("a") and client.exists("c") and client.exists("d")
        readers = [store.master.get("c"), store.master.get("d")]
        with pytest.raises(NoSpace):
            client.put("e", half)  # both are being read: nothing may go
        store.master.release_leases([[k, m["lease_id"]]
                                     for k, m in zip("cd", readers, strict=True)])
        client.put("e", half)
        assert not client.exists("c") and client.exists("d") and client.exists("e")


def test_get_releases_its_lease_when_the_read_completes(master: MasterServer) -> None:
    node = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="n").start()
    try:
        with StoreClient(master.address, transfer_config=TCP) as client:
            client.put("k", b"abc")
            client.put("j", b"defg")
            objects = master.service.index.objects
            assert client.get("k") == b"abc"
            assert client.get_into("j", bytearray(4)) == 4
            assert client.get_batch_into(["k", "j", "gone"], [bytearray(4)] * 3) == [3, 4, None]
            client.exists("k")  # one answered call: the one-way releases before it are done
            assert objects["k"].leases == {} and objects["j"].leases == {}
            assert master.service.stats()["used_bytes"] > 0
            client.remove_batch(["k", "j"])  # unleased: the space is free at once
            assert master.service.stats()["used_bytes"] == 0
    finally:
        node.close()


def test_master_and_nodes_expire_and_reclaim(master: MasterServer, clock: ManualClock) -> None:
    node = StoreNode(NodeConfig(1 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="quiet").start()
    try:
        with StoreClient(master.address, transfer_config=TCP) as client:
            client.put("k", b"abc")
            descs = client.master.put_start("pending", 100, 0)  # a writer that never commits
            assert len(descs) == 1
            clock.advance(9.0)
            assert master.service.tick() == []
            clock.advance(31.0)  # put_timeout_s (30) and heartbeat_timeout_s (10) both pass
            assert master.service.tick() == ["quiet"]
            with pytest.raises(ObjectNotFound):
                client.get("k")
            with pytest.raises(ObjectNotFound, match="no put in progress"):
                client.master.put_commit("pending")
    finally:
        node.close()
