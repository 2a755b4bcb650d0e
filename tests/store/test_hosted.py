"""A master hosting a node in its process (store/hosted.py): a single put is one request.

Same semantics as a separate master and node: two-phase (nothing readable before its verified
write), ObjectExists for a stored key, remove / eviction / revocation, replicas on other nodes,
a node's death; plus the inline path's own bad input. Clocks are manual; nothing sleeps.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import MasterConfig, NodeConfig
from kvcake.store.errors import InvalidRequest, ObjectExists, ObjectNotFound
from kvcake.store.hosted import HostedConfig, HostedStore, InlinePuts
from kvcake.store.layout import HEADER_BYTES, payload_checksum, verify
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.payload import MAX_PAYLOAD_BYTES
from kvcake.store.protocol import FrameReader, encode
from kvcake.store.remote import RemoteMaster
from kvcake.transfer import TransferConfig

TCP = TransferConfig(serve=False, use_shared_memory=False, num_rails=1)
CONFIG = MasterConfig(put_timeout_s=30.0, lease_s=5.0, heartbeat_timeout_s=10.0)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def _hosted(clock: ManualClock, dram: int = 8 << 20,
            config: MasterConfig = CONFIG) -> HostedStore:
    return HostedStore(HostedConfig(config, NodeConfig(dram_bytes=dram), node_id="hosted",
                                    tick_interval_s=None), clock=clock,
                       transfer_config=TransferConfig(host="127.0.0.1", num_rails=1))


@pytest.fixture
def hosted(clock: ManualClock) -> Iterator[HostedStore]:
    store = _hosted(clock).start()
    yield store
    store.close()


def _count(monkeypatch: pytest.MonkeyPatch, target: Any, names: list[str]) -> dict[str, int]:
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(target, name)

        def counted(*args: Any, _name: str = name, _f: Any = original, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(target, name, counted)
    return calls


def test_a_put_is_one_inline_request_and_reads_back(hosted: HostedStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count(monkeypatch, hosted.service,
                   ["put_start", "put_commit", "put_slots", "put_start_batch"])
    with StoreClient(hosted.address, transfer_config=TCP) as client:
        sent = _count(monkeypatch, client.master, ["put_inline", "put_slots"])
        values = {f"k{n}": bytes((n + i) % 251 for i in range(n)) for n in
                  (0, 1, 4096, 65536, (1 << 20) + 3)}
        for key, value in values.items():
            assert client.put(key, value) is True
        assert sent == {"put_inline": 5, "put_slots": 0}
        assert calls == {"put_start": 5, "put_commit": 5, "put_slots": 0, "put_start_batch": 0}
        for key, value in values.items():
            assert client.get(key) == value
        assert client.put("k1", b"other bytes") is False  # keys name content: first write wins
        assert client.get("k1") == values["k1"]
    with StoreClient(hosted.address, transfer_config=TCP, location_cache=0) as other:
        for key, value in values.items():  # through the master: same objects, same bytes
            assert other.get(key) == value
        assert other.exists("k65536")
        other.remove("k65536")
        with pytest.raises(ObjectNotFound):
            other.get("k65536")


def test_a_removed_object_is_not_served_from_a_remembered_location(hosted: HostedStore) -> None:
    with StoreClient(hosted.address, transfer_config=TCP) as writer, \
            StoreClient(hosted.address, transfer_config=TCP) as remover:
        writer.put("a", b"x" * 5000)
        assert writer.get("a") == b"x" * 5000
        remover.remove("a")  # the in-process node revokes the replica before the answer
        with pytest.raises(ObjectNotFound):
            writer.get("a")


def test_eviction_is_the_masters_and_revokes_what_it_drops(clock: ManualClock) -> None:
    config = MasterConfig(put_timeout_s=30.0, lease_s=5.0, heartbeat_timeout_s=10.0,
                          high_watermark=0.8, low_watermark=0.5)
    with _hosted(clock, dram=1 << 20, config=config) as store, \
            StoreClient(store.address, transfer_config=TCP) as client:
        keys = [f"e{i}" for i in range(24)]
        for i, key in enumerate(keys):
            client.put(key, bytes([i]) * (64 << 10))
            clock.advance(1.0)
        assert store.service.stats()["num_evicted"] > 0
        gone = [k for k in keys if not client.exists(k)]
        assert gone and gone == keys[:len(gone)]  # least recently used first
        for key in gone:  # remembered by this client, yet not served
            with pytest.raises(ObjectNotFound):
                client.get(key)
        assert client.get(keys[-1]) == bytes([23]) * (64 << 10)


def test_a_payload_that_does_not_match_its_checksum_is_not_stored(hosted: HostedStore) -> None:
    remote = RemoteMaster(hosted.address)
    try:
        data = memoryview(b"y" * 3000)
        with pytest.raises(InvalidRequest, match="checksum"):
            remote.put_inline("bad", data, payload_checksum(data) ^ 1)
        assert not remote.exists("bad")
        assert hosted.service.stats()["used_bytes"] == 0
        # the connection stays in step, and the key is free for a correct put
        descs = remote.put_inline("bad", data, payload_checksum(data))
        assert [d["node_id"] for d in descs] == ["hosted"] and remote.exists("bad")
        with pytest.raises(ObjectExists):  # refused before the payload is read: skipped
            remote.put_inline("bad", data, payload_checksum(data))
        assert remote.exists("bad")
    finally:
        remote.close()


def test_bad_inline_requests_say_what_to_change(hosted: HostedStore) -> None:
    puts = InlinePuts(hosted.service, hosted.node, max_bytes=1024)
    with pytest.raises(InvalidRequest, match="inline limit"):
        puts.put_inline("big", 2048, 0, lambda view: None)
    with pytest.raises(InvalidRequest, match="key"):
        puts.put_inline("", 10, payload_checksum(b"0123456789"),
                        lambda view: view.__setitem__(slice(None), b"0123456789"))
    with pytest.raises(ValueError, match="max_bytes"):
        InlinePuts(hosted.service, hosted.node, max_bytes=0)
    with pytest.raises(ValueError, match="tick_interval_s"):
        HostedConfig(CONFIG, NodeConfig(dram_bytes=1 << 20), tick_interval_s=0.0)
    with pytest.raises(ValueError, match="port"):
        HostedConfig(CONFIG, NodeConfig(dram_bytes=1 << 20), port=70000)
    # a payload size the server cannot trust: an error reply, then the connection is closed
    host, port = hosted.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(encode({"id": 1, "op": "put_inline",
                             "args": {"key": "k", "size_bytes": MAX_PAYLOAD_BYTES + 1,
                                      "checksum": 0}}))
        reply = FrameReader(sock).read()
        assert isinstance(reply, dict) and not reply["ok"]
        assert "size_bytes" in reply["error"]["message"]
        assert sock.recv(1) == b""


def test_a_stream_cut_inside_the_payload_leaves_nothing(hosted: HostedStore) -> None:
    puts = hosted.server.puts

    def cut(view: memoryview) -> None:
        view[:10] = b"0" * 10
        raise ConnectionError("the stream ended inside a payload")

    with pytest.raises(ConnectionError):
        puts.put_inline("cut", 5000, 0, cut)
    assert not hosted.service.exists("cut")
    assert hosted.service.stats()["used_bytes"] == 0


def test_other_nodes_join_hold_replicas_and_may_die(hosted: HostedStore,
                                                    clock: ManualClock) -> None:
    other = StoreNode(NodeConfig(dram_bytes=8 << 20), hosted.address, node_id="other",
                      transfer_config=TransferConfig(host="127.0.0.1", num_rails=1)).start()
    try:
        with StoreClient(hosted.address, transfer_config=TCP, num_replicas=2) as client:
            value = bytes(range(256)) * 300
            assert client.put("two", value) is True
            meta = hosted.service.index.objects["two"]
            assert sorted(r.node_id for r in meta.dram()) == ["hosted", "other"]
            (remote,) = [r for r in meta.dram() if r.node_id == "other"]
            view = other._view()  # the hosting process wrote it through its engine
            start = remote.offset + HEADER_BYTES
            verify(view[remote.offset:start], view[start:start + len(value)], remote.version,
                   payload_checksum(value))
            client.num_replicas = 1
            other.close(unregister=False)  # dies: the master notices by the missed heartbeats
            clock.advance(11.0)  # (or its closed master connection said so first)
            hosted.service.tick()
            assert "other" not in hosted.service.index.nodes
            assert client.get("two") == value  # the hosted replica survives
            assert [r.node_id for r in hosted.service.index.objects["two"].dram()] == ["hosted"]
    finally:
        other.close(unregister=False)


def test_a_master_without_a_node_is_asked_the_usual_way(clock: ManualClock,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    service = MasterService(CONFIG, clock)
    with MasterServer(service, "127.0.0.1", 0, tick_interval_s=None) as server:
        node = StoreNode(NodeConfig(dram_bytes=4 << 20), service, node_id="n",
                         transfer_config=TransferConfig(host="127.0.0.1", num_rails=1)).start()
        try:
            with StoreClient(server.address, transfer_config=TCP) as client:
                assert isinstance(client.master, RemoteMaster)
                assert client.master.inline_max_bytes() == 0
                sent = _count(monkeypatch, client.master, ["put_inline", "put_slots"])
                assert client.put("p", b"") and client.put("q", b"z" * 100)
                assert sent["put_inline"] == 0 and sent["put_slots"] >= 1
                assert client.get("q") == b"z" * 100
            with StoreClient(server.address, transfer_config=TCP, async_seal=True) as sealing:
                assert sealing.put("s", b"s" * 100) and sealing.put("t", b"t" * 100)  # named
                assert sealing.get("s") == b"s" * 100  # over TCP, then sealed one-way
        finally:
            node.close()


def test_cli_with_node_refuses_etcd() -> None:
    done = subprocess.run([sys.executable, "-m", "kvcake.store", "master", "--port", "0",
                           "--with-node", "1MiB", "--etcd", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--with-node" in done.stderr
