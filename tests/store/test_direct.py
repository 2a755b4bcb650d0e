"""The direct path: small gets and puts move on the caller's thread, and a fault there falls back
to the engine without ever serving wrong bytes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvcake.store import StoreClient
from kvcake.store.config import NodeConfig
from kvcake.store.direct import DirectPath
from kvcake.store.errors import StoreError
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.transfer import (
    EndpointKey,
    FaultSpec,
    FaultyTransport,
    SegmentDesc,
    TransferConfig,
    TransferOp,
    TransferRequest,
    TransportError,
)
from kvcake.transfer import Transport as TransportT
from tests.store.conftest import put_then_get_all

TCP = TransferConfig(serve=False, use_shared_memory=False, num_rails=2, slice_bytes=1 << 20)


class Recording:
    """Wraps a transport; records which thread ran each call, and can fail the first N writes."""

    def __init__(self, inner: TransportT, threads: list[str], failing_writes: list[int]) -> None:
        self.inner = inner
        self._threads = threads
        self._failing = failing_writes

    def read(self, *args: Any, **kwargs: Any) -> Any:
        self._threads.append(threading.current_thread().name)
        return self.inner.read(*args, **kwargs)

    def write(self, *args: Any, **kwargs: Any) -> Any:
        self._threads.append(threading.current_thread().name)
        if self._failing and self._failing[0] > 0:
            self._failing[0] -= 1
            raise TransportError("injected: connection reset")
        return self.inner.write(*args, **kwargs)

    def close(self) -> None:
        self.inner.close()


class RecordingPipelined(Recording):
    """As Recording, for a pipelined inner transport (TCP): requests are started, then settled."""

    pipelined = True
    inner: Any

    def start_read(self, *args: Any, **kwargs: Any) -> Any:
        self._threads.append(threading.current_thread().name)
        return self.inner.start_read(*args, **kwargs)

    def start_write(self, *args: Any, **kwargs: Any) -> Any:
        self._threads.append(threading.current_thread().name)
        return self.inner.start_write(*args, **kwargs)

    def next_completion(self) -> Any:
        return self.inner.next_completion()

    @property
    def num_outstanding(self) -> int:
        return int(self.inner.num_outstanding)


@pytest.fixture
def node(master: MasterServer) -> Iterator[StoreNode]:
    node = StoreNode(NodeConfig(4 << 20, heartbeat_interval_s=3600), master.address,
                     node_id="n0").start()
    yield node
    node.close()


def test_small_objects_move_on_the_callers_thread(master: MasterServer, node: StoreNode) -> None:
    threads: list[str] = []

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        return Recording(inner, threads, [])  # type: ignore[return-value]

    value = os.urandom(300_000)
    with StoreClient(master.address, transfer_config=TCP, wrap_transport=wrap) as client:
        assert client.put("k", value)
        assert client.get("k") == value
        buffer = bytearray(300_000)
        assert client.get_into("k", buffer) == 300_000 and buffer == value
        assert client.get_batch_into(["k"], [bytearray(300_000)]) == [300_000]
    me = threading.current_thread().name
    # put: header, payload; get: one request (header + payload into a scratch buffer);
    # get_into and the batch: header, payload
    assert threads == [me] * 7


def test_pipelined_requests_to_one_node_take_one_round_trip(master: MasterServer,
                                                            node: StoreNode) -> None:
    threads: list[str] = []

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        return RecordingPipelined(inner, threads, [])  # type: ignore[return-value]

    values = [os.urandom(n) for n in (0, 1, 70_000, 900_000)]
    with StoreClient(master.address, transfer_config=TCP, wrap_transport=wrap) as client:
        for i, value in enumerate(values):
            assert client.put(f"k{i}", value)
        assert [client.get(f"k{i}") for i in range(4)] == values
        buffers = [bytearray(len(v)) for v in values]
        assert client.get_batch_into([f"k{i}" for i in range(4)], buffers) == [0, 1, 70_000,
                                                                               900_000]
        assert [bytes(b) for b in buffers] == values
    me = threading.current_thread().name
    # puts: one joined request up to JOIN_BYTES, else header + payload; gets: 1; batch: 1 + 3 * 2
    assert threads == [me] * (5 + 4 + 7)


def test_a_failed_direct_write_is_retried_by_the_engine(master: MasterServer,
                                                         node: StoreNode) -> None:
    threads: list[str] = []
    failing = [1]  # the first write, on the caller's thread, fails

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        return Recording(inner, threads, failing)  # type: ignore[return-value]

    value = os.urandom(200_000)
    with StoreClient(master.address, transfer_config=TCP, wrap_transport=wrap) as client:
        assert client.put("k", value)
        assert client.get("k") == value
    # the failed joined write (header + payload: under JOIN_BYTES), the engine's retry, the read
    assert failing == [0] and len(threads) == 3


@pytest.mark.parametrize("seed", [0, 1])
def test_faults_on_the_direct_path_never_yield_wrong_bytes(master: MasterServer,
                                                           node: StoreNode, seed: int) -> None:
    faulty: list[FaultyTransport] = []

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        faulty.append(FaultyTransport(inner, FaultSpec(drop_rate=0.15, corrupt_rate=0.25),
                                      seed=seed * 10 + len(faulty)))
        return faulty[-1]

    values = {f"k{i}": os.urandom(3_000 + 1_009 * i) for i in range(30)}
    with StoreClient(master.address, transfer_config=TCP, wrap_transport=wrap) as client:
        served, failed = put_then_get_all(client, values)
    assert sum(f.num_corrupted for f in faulty) > 0 and sum(f.num_dropped for f in faulty) > 0
    assert served > 0 and served + failed == len(values)


@pytest.mark.parametrize("seed", [0, 1])
def test_faults_never_make_a_batch_get_return_wrong_bytes(master: MasterServer, node: StoreNode,
                                                          seed: int) -> None:
    faulty: list[FaultyTransport] = []

    def wrap(inner: TransportT, key: EndpointKey, rail: int) -> TransportT:
        faulty.append(FaultyTransport(inner, FaultSpec(drop_rate=0.1, corrupt_rate=0.3),
                                      seed=seed * 10 + len(faulty)))
        return faulty[-1]

    values = {f"k{i}": os.urandom(2_000 + 1_013 * i) for i in range(12)}
    with StoreClient(master.address, transfer_config=TCP) as clean:
        assert clean.put_batch(list(values), list(values.values())) == [True] * len(values)
    with StoreClient(master.address, transfer_config=TCP, wrap_transport=wrap) as client:
        served = 0
        for _ in range(4):  # each batch either serves exactly the bytes put or raises
            try:
                got = client.get_batch([*values, "missing"])
            except StoreError:
                continue
            assert got == [*values.values(), None]
            served += 1
    assert sum(f.num_corrupted for f in faulty) > 0  # the batches did meet corrupted reads
    assert served > 0


def test_direct_path_refuses_large_batches_and_reports_faults_without_raising() -> None:
    direct = DirectPath(TransferConfig(serve=False, slice_bytes=64 << 10))
    segment = SegmentDesc("s", 1, 1 << 20, "127.0.0.1:1", "elsewhere")  # nobody listens there
    small = [TransferRequest(TransferOp.WRITE, bytes(1000), segment, 0)]
    large = [TransferRequest(TransferOp.WRITE, bytes(40 << 10), segment, 0)] * 2
    assert direct.accepts(small) and not direct.accepts(large)
    assert direct.transfer(small) is False  # cannot connect: the caller falls back to the engine
    direct.close()
    assert not direct.accepts(small)
