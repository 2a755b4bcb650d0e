"""Node death during a get, faulty transports: never wrong bytes, always a clear outcome."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvcake.clock import ManualClock
from kvcake.store import StoreClient
from kvcake.store.config import EmbeddedConfig, NodeConfig
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.errors import ObjectNotFound, StoreError, TransferFailed
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.transfer import (
    EndpointKey,
    FaultSpec,
    FaultyTransport,
    TransferConfig,
    TransferEngine,
)
from kvcake.transfer import Transport as TransportT
from tests.store.conftest import put_then_get_all


class KillOnFirstRead:
    """Wraps a transport; the first read through any wrapper runs `kill` first (a node dying
    while the client's get is in flight)."""

    fired = threading.Event()
    pipelined = False  # the engine must call read() (not the inner transport's pipelined calls)

    def __init__(self, inner: TransportT, kill: Callable[[], None]) -> None:
        self.inner = inner
        self._kill = kill

    def read(self, *args: Any, **kwargs: Any) -> Any:
        if not KillOnFirstRead.fired.is_set():
            KillOnFirstRead.fired.set()
            self._kill()
        return self.inner.read(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # write, close, ...: as the inner transport
        return getattr(self.inner, name)


def _start_nodes(master: MasterServer, num: int) -> list[StoreNode]:
    return [StoreNode(NodeConfig(2 << 20, heartbeat_interval_s=3600), master.address,
                      node_id=f"n{i}", transfer_config=TransferConfig(num_rails=1)).start()
            for i in range(num)]


def _killer_client(master: MasterServer, victim: StoreNode, replicas: int) -> StoreClient:
    KillOnFirstRead.fired.clear()

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> Any:
        return KillOnFirstRead(inner, lambda: victim.close(unregister=False))

    engine = TransferEngine(TransferConfig(serve=False, use_shared_memory=False, num_rails=1,
                                           max_retries=1, io_timeout_s=5.0), wrap_transport=wrap)
    engine.start()
    client = StoreClient(master.address, engine=engine, num_replicas=replicas)
    client._own_engine = True  # close() stops it
    return client


def test_node_killed_during_get_serves_the_other_replica(master: MasterServer) -> None:
    nodes = _start_nodes(master, 2)
    try:
        writer = StoreClient(master.address, num_replicas=2,
                             transfer_config=TransferConfig(serve=False, use_shared_memory=False))
        data = os.urandom(300_000)
        writer.put("k", data)
        first = writer.master.get("k")["replicas"][0]["node_id"]
        victim = next(n for n in nodes if n.node_id == first)
        with _killer_client(master, victim, 2) as client:
            assert client.get("k") == data  # the first replica's node died mid-read
        assert KillOnFirstRead.fired.is_set()
        writer.close()
    finally:
        for node in nodes:
            node.close()


def test_node_killed_during_get_of_its_only_replica_is_a_key_error(master: MasterServer) -> None:
    nodes = _start_nodes(master, 1)
    try:
        with StoreClient(master.address, transfer_config=TransferConfig(
                serve=False, use_shared_memory=False)) as writer:
            writer.put("k", os.urandom(100_000))
        with _killer_client(master, nodes[0], 1) as client, pytest.raises(KeyError):
            client.get("k")
    finally:
        nodes[0].close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_faulty_transport_never_yields_corrupted_bytes(seed: int) -> None:
    spec = FaultSpec(drop_rate=0.15, corrupt_rate=0.25)
    faulty: list[FaultyTransport] = []

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        faulty.append(FaultyTransport(inner, spec, seed=seed * 10 + len(faulty)))
        return faulty[-1]

    values = {f"k{i}": os.urandom(5_000 + 997 * i) for i in range(40)}
    with EmbeddedStore(EmbeddedConfig(4 << 20, num_nodes=2), wrap_transport=wrap) as store:
        client = store.client(num_replicas=2)
        served, failed = put_then_get_all(client, values)
        keys = list(values)
        buffers = [bytearray(len(values[k])) for k in keys]
        # Under these faults a batch may fail as a whole (some object has no intact replica
        # left, or all its reads were hit): then it must say so with TransferFailed naming
        # the key; when it returns, every filled buffer holds exactly the bytes put.
        try:
            sizes = client.get_batch_into(keys, buffers)
        except TransferFailed as exc:
            assert any(repr(key) in str(exc) for key in keys), exc
        else:
            assert len(sizes) == len(keys)
            for key, size, buffer in zip(keys, sizes, buffers, strict=True):
                assert size in (None, len(values[key]))
                if size is not None:
                    assert bytes(buffer) == values[key]
    assert sum(f.num_corrupted for f in faulty) > 0 and sum(f.num_dropped for f in faulty) > 0
    assert served > 0  # faults were injected, reads still got through, none was wrong
    assert served + failed == len(values)


def _corrupt(store: EmbeddedStore, replica: dict[str, Any]) -> None:
    """Flip the first payload byte of one replica, at rest in its node's memory."""
    node = next(n for n in store.nodes if n.node_id == replica["node_id"])
    node._view()[replica["offset"] + HEADER_BYTES] ^= 0xFF


def test_batch_read_takes_the_intact_replica_or_names_the_object_it_cannot_read() -> None:
    """Deterministic faults: one replica of `a` and both of `b` corrupted at rest."""
    values = {key: os.urandom(20_000 + 1000 * i) for i, key in enumerate("abc")}
    with EmbeddedStore(EmbeddedConfig(4 << 20, num_nodes=2)) as store:
        client = store.client(num_replicas=2)
        for key, value in values.items():
            client.put(key, value)
        metas = {key: client.master.get(key) for key in values}
        assert all(len(m["replicas"]) == 2 for m in metas.values())
        _corrupt(store, metas["a"]["replicas"][0])
        buffers = [bytearray(len(values[k])) for k in "ac"] + [bytearray(10)]
        assert client.get_batch_into(["a", "c", "never-put"], buffers) == [20_000, 22_000, None]
        assert bytes(buffers[0]) == values["a"] and bytes(buffers[1]) == values["c"]
        for replica in metas["b"]["replicas"]:
            _corrupt(store, replica)
        with pytest.raises(TransferFailed, match="'b' could be read intact"):
            client.get_batch_into(["a", "b"], [bytearray(20_000), bytearray(21_000)])
        assert client.get("a") == values["a"] and client.get("c") == values["c"]


def test_removed_key_is_not_found_even_with_an_old_descriptor() -> None:
    clock = ManualClock(0.0)
    with EmbeddedStore(EmbeddedConfig(1 << 20), clock=clock) as store:
        client = store.client()
        client.put("old", b"A" * 1000)
        stale = client.master.get("old")
        client.remove("old")
        clock.advance(60.0)  # the lease ends: only then is the range free for reuse
        store.master.tick()
        client.put("new", b"B" * 1000)  # reuses the same range with a new version
        assert client.master.get("new")["replicas"][0]["offset"] == stale["replicas"][0]["offset"]
        buffer = bytearray(1000)
        with pytest.raises(ObjectNotFound):  # the stale descriptor is refused, then re-asked
            client._read("old", stale, memoryview(buffer))
        assert client.get("new") == b"B" * 1000


def test_a_put_corrupted_on_its_way_over_tcp_fails_instead_of_committing(
        master: MasterServer) -> None:
    """The engine's default carries no digest on TCP; the store's puts still do (their object
    checksum), so the node refuses bytes that changed on the way and nothing wrong is committed."""
    nodes = _start_nodes(master, 1)
    faulty: list[FaultyTransport] = []

    def corrupt_all(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        faulty.append(FaultyTransport(inner, FaultSpec(corrupt_rate=1.0), seed=len(faulty)))
        return faulty[-1]

    config = TransferConfig(serve=False, use_shared_memory=False, num_rails=1, max_retries=1)
    assert config.checksum_tcp is False
    try:
        with StoreClient(master.address, transfer_config=config,
                         wrap_transport=corrupt_all) as client:
            with pytest.raises(StoreError, match="checksum mismatch"):
                client.put("k", os.urandom(300_000))
            assert not client.exists("k")
            with pytest.raises(KeyError):
                client.get("k")
        assert sum(f.num_corrupted for f in faulty) > 0
        with StoreClient(master.address, transfer_config=config) as client:
            data = os.urandom(300_000)
            client.put("k", data)  # the failed put left nothing behind
            assert client.get("k") == data
    finally:
        nodes[0].close()
