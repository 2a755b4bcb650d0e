"""SSD tier: an evicted object is demoted to its node's disk and promoted back on a hit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import EmbeddedConfig, MasterConfig, NodeConfig
from kvcake.store.disk import DiskTier
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.layout import HEADER_BYTES, CorruptObject, pack_header
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.transfer import TransferConfig

SLOT = 100_000


def _disk_files(store: EmbeddedStore, directory: Path) -> tuple[set[str], set[str]]:
    """(files on disk, files the master's index says should be there)."""
    expected = {f"{r.version}.kvc" for m in store.master.index.objects.values()
                for r in m.disk()}
    return {p.name for p in directory.glob("*.kvc")}, expected


def test_demote_and_promote_round_trip_embedded(tmp_path: Path) -> None:
    clock = ManualClock(0.0)
    config = MasterConfig(lease_s=1.0, heartbeat_timeout_s=1e9)
    values = {k: os.urandom(SLOT) for k in "abc"}
    disk_dir = tmp_path / "node-0"
    with EmbeddedStore(EmbeddedConfig(250_000, str(tmp_path), 1 << 20, master=config),
                       clock=clock) as store:
        client = store.client()
        client.put("a", values["a"])
        client.put("b", values["b"])
        client.put("c", values["c"])  # DRAM holds two objects: a (the oldest) is demoted
        files, expected = _disk_files(store, disk_dir)
        assert len(files) == 1 and files == expected and client.stats()["num_demoted"] == 1
        assert client.exists("a") and store.master.index.objects["a"].dram() == []
        clock.advance(2.0)
        assert client.get("a") == values["a"]  # promoted; b (now the oldest) is demoted
        assert client.stats()["num_demoted"] == 2
        assert store.master.index.objects["b"].dram() == []
        clock.advance(2.0)
        assert client.get("b") == values["b"]  # promoted; c is demoted
        assert client.get("c") == values["c"]  # promoted; a is dropped from DRAM, keeps disk
        assert client.stats()["num_demoted"] == 3
        files, expected = _disk_files(store, disk_dir)
        assert files == expected and len(files) == 3
        client.remove("a")  # its disk copy is deleted too
        files, expected = _disk_files(store, disk_dir)
        assert files == expected and len(files) == 2
        assert client.stats()["disk_used_bytes"] == sum(
            (disk_dir / name).stat().st_size for name in files)


def test_a_demote_the_node_fails_is_not_counted(tmp_path: Path) -> None:
    def refuse(*args: object) -> None:
        raise OSError("disk full")

    with EmbeddedStore(EmbeddedConfig(250_000, str(tmp_path), 1 << 20)) as store:
        store.nodes[0].demote = refuse  # type: ignore[method-assign]
        client = store.client()
        for key in "abc":
            client.put(key, os.urandom(SLOT))  # c evicts a: its demote fails, a is lost
        assert client.stats()["num_demoted"] == 0 and client.stats()["disk_used_bytes"] == 0
        assert not client.exists("a") and client.exists("b") and client.exists("c")


def test_a_full_disk_makes_room_by_dropping_its_least_recent_objects(tmp_path: Path) -> None:
    values = {k: os.urandom(SLOT) for k in "abcde"}
    disk_dir = tmp_path / "node-0"
    config = EmbeddedConfig(250_000, str(tmp_path), 2 * (SLOT + HEADER_BYTES),  # 2 on disk
                            master=MasterConfig(heartbeat_timeout_s=1e9))
    with EmbeddedStore(config) as store:
        client = store.client()
        for key in "abcd":
            client.put(key, values[key])  # c demotes a, d demotes b: the disk is full
        client.put("e", values["e"])  # evicts c; the disk drops a (its LRU) to take it
        assert not client.exists("a") and client.stats()["num_disk_evicted"] == 1
        files, expected = _disk_files(store, disk_dir)
        assert files == expected and len(files) == 2
        assert client.get("c") == values["c"]  # promoted; d is demoted and b dropped for it
        assert not client.exists("b") and client.stats()["num_disk_evicted"] == 2
        assert [client.get(k) == values[k] for k in "cde"] == [True, True, True]
        files, expected = _disk_files(store, disk_dir)
        assert files == expected and client.stats()["disk_used_bytes"] == sum(
            (disk_dir / name).stat().st_size for name in files)


def test_demote_and_promote_through_a_remote_node(master: MasterServer, clock: ManualClock,
                                                  tmp_path: Path) -> None:
    node = StoreNode(NodeConfig(250_000, str(tmp_path), 1 << 20, heartbeat_interval_s=3600),
                     master.address, node_id="disky").start()
    try:
        with StoreClient(master.address, transfer_config=TransferConfig(
                serve=False, use_shared_memory=False)) as client:
            values = [os.urandom(SLOT) for _ in range(3)]
            for i, value in enumerate(values):
                client.put(f"k{i}", value)  # k0 goes to disk through the node's control port
            assert len(list(tmp_path.glob("*.kvc"))) == 1
            clock.advance(10.0)
            assert client.get("k0") == values[0]
            for i, value in enumerate(values):  # each get promotes, demoting the oldest
                clock.advance(10.0)  # (past the leases of earlier gets)
                assert client.get(f"k{i}") == value
            assert master.service.stats()["num_demoted"] == 3  # k0, k1, k2; k0 kept its copy
    finally:
        node.close()


def test_disk_tier_refuses_wrong_copies(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path).open()
    segment = memoryview(bytearray(4096))
    segment[:HEADER_BYTES] = pack_header(0, 7, 100)
    with pytest.raises(CorruptObject, match="version 7, not 8"):
        disk.demote(segment, 0, 100 + HEADER_BYTES, 8, 99)
    disk.demote(segment, 0, 100 + HEADER_BYTES, 7, 99)
    with pytest.raises(CorruptObject, match="expected"):
        disk.promote(segment, 1024, 50, 12, 99)
    disk.promote(segment, 1024, 100 + HEADER_BYTES, 12, 99)
    assert bytes(segment[1024 + HEADER_BYTES:1024 + HEADER_BYTES + 100]) == bytes(100)
    disk.drop(99)
    assert disk.used_bytes() == 0
