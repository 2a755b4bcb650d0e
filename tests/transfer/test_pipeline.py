"""Pipelined slices: several in flight per connection, replies matched by id in any order, and a
dropped or corrupted slice among them retried alone while the others complete."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvcake.transfer import (
    EndpointKey,
    FaultSpec,
    FaultyTransport,
    SegmentDesc,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    Transport,
    TransportError,
    TransportKind,
    frame,
)
from kvcake.transfer.checksum import ChecksumKind, Digest
from kvcake.transfer.frame import Header, Op
from kvcake.transfer.tcp import TcpTransport, recv_exactly
from kvcake.transfer.transport import Completion, PipelinedTransport
from tests.transfer.conftest import SERVER_CONFIG

SLICE = 4096
DROPPED = {TransferOp.READ: 8, TransferOp.WRITE: 12}
CORRUPTED = {TransferOp.READ: 12, TransferOp.WRITE: 12}
KIND = ChecksumKind.CRC32  # always installed


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Peak:
    """Passes everything to a pipelined transport and records the most slices in flight."""

    def __init__(self, inner: PipelinedTransport, peaks: list[int]) -> None:
        self.inner, self.peaks, self.pipelined = inner, peaks, True
        peaks.append(0)
        self.index = len(peaks) - 1

    @property
    def num_outstanding(self) -> int:
        return self.inner.num_outstanding

    def start_read(self, segment, offset, dest, *, checksum):  # type: ignore[no-untyped-def]
        token = self.inner.start_read(segment, offset, dest, checksum=checksum)
        self.peaks[self.index] = max(self.peaks[self.index], self.inner.num_outstanding)
        return token

    def start_write(self, segment, offset, src, *, checksum, digest):  # type: ignore[no-untyped-def]
        token = self.inner.start_write(segment, offset, src, checksum=checksum, digest=digest)
        self.peaks[self.index] = max(self.peaks[self.index], self.inner.num_outstanding)
        return token

    def next_completion(self) -> Completion:
        return self.inner.next_completion()

    def read(self, segment, offset, dest, *, checksum):  # type: ignore[no-untyped-def]
        return self.inner.read(segment, offset, dest, checksum=checksum)

    def write(self, segment, offset, src, *, checksum, digest):  # type: ignore[no-untyped-def]
        self.inner.write(segment, offset, src, checksum=checksum, digest=digest)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def owner() -> Iterator[tuple[TransferEngine, SegmentDesc]]:
    with TransferEngine(SERVER_CONFIG) as engine:
        yield engine, engine.allocate_segment("dram", 64 * SLICE, shared=False)


def client_config(**changes: object) -> TransferConfig:
    values: dict[str, object] = dict(serve=False, use_shared_memory=False, num_rails=2,
                                     slice_bytes=SLICE, pipeline_depth=8, inline_max_slices=0,
                                     checksum="crc32", checksum_tcp=True, io_timeout_s=10.0)
    values.update(changes)
    return TransferConfig(**values)  # type: ignore[arg-type]


def test_slices_are_in_flight_together_and_land_in_place(
        owner: tuple[TransferEngine, SegmentDesc]) -> None:
    engine, desc = owner
    data = pattern(64 * SLICE, seed=1)
    peaks: list[int] = []
    wrap = lambda t, key, rail: Peak(t, peaks)  # noqa: E731
    with TransferEngine(client_config(), wrap_transport=wrap) as client:
        client.write(desc, 0, data)
        assert np.array_equal(engine.segment("dram").array, data)
        out = np.zeros(64 * SLICE, np.uint8)
        client.read(desc, 0, out)
        assert np.array_equal(out, data)
    # 32 slices per rail, up to 8 at once: the rails did not wait for each reply
    assert len(peaks) == 2 and all(1 < peak <= 8 for peak in peaks)


def faulty_rail_zero(spec: FaultSpec,
                     injected: dict[int, list[FaultyTransport]]):  # type: ignore[no-untyped-def]
    """Faults on rail 0 only; every endpoint each rail opened, by rail."""
    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        injected.setdefault(rail, []).append(
            FaultyTransport(t, spec if rail == 0 else FaultSpec(), seed=7))
        return injected[rail][-1]
    return wrap


@pytest.mark.parametrize("op", [TransferOp.READ, TransferOp.WRITE])
def test_a_dropped_slice_among_many_in_flight_is_retried_alone(
        owner: tuple[TransferEngine, SegmentDesc], op: TransferOp) -> None:
    engine, desc = owner
    source = pattern(64 * SLICE, seed=2)
    engine.segment("dram").array[:] = source if op is TransferOp.READ else 0
    injected: dict[int, list[FaultyTransport]] = {}
    with TransferEngine(client_config(), wrap_transport=faulty_rail_zero(
            FaultSpec(drop_rate=0.25), injected)) as client:
        buffer = np.zeros_like(source) if op is TransferOp.READ else source
        client.transfer([TransferRequest(op, buffer, desc)], timeout_s=30)
    assert np.array_equal(buffer if op is TransferOp.READ else engine.segment("dram").array,
                          source)
    # rail 0 (32 slices, seeded) dropped the same slices every run, each failing alone: its one
    # connection carried the rest, and rail 1 carried the retries
    assert [len(injected[0]), len(injected[1])] == [1, 1]
    assert injected[0][0].num_dropped == DROPPED[op] and injected[1][0].num_dropped == 0


@pytest.mark.parametrize("op", [TransferOp.READ, TransferOp.WRITE])
def test_corruption_mid_pipeline_is_caught_and_retried(
        owner: tuple[TransferEngine, SegmentDesc], op: TransferOp) -> None:
    engine, desc = owner
    source = pattern(64 * SLICE, seed=3)
    engine.segment("dram").array[:] = source if op is TransferOp.READ else 0
    injected: dict[int, list[FaultyTransport]] = {}
    with TransferEngine(client_config(), wrap_transport=faulty_rail_zero(
            FaultSpec(corrupt_rate=0.3), injected)) as client:
        buffer = np.zeros_like(source) if op is TransferOp.READ else source
        client.transfer([TransferRequest(op, buffer, desc)], timeout_s=30)
    assert np.array_equal(buffer if op is TransferOp.READ else engine.segment("dram").array,
                          source)
    # seeded; a bad slice fails alone (retried on rail 1): rail 0 never reconnected
    assert injected[0][0].num_corrupted == CORRUPTED[op]
    assert [len(injected[0]), len(injected[1])] == [1, 1]


def test_an_endpoint_evicted_with_slices_in_flight_settles_them_first(
        owner: tuple[TransferEngine, SegmentDesc]) -> None:
    engine, desc = owner
    engine.segment("dram").array[:] = pattern(64 * SLICE, seed=4)
    with TransferEngine(SERVER_CONFIG) as other:
        other_desc = other.allocate_segment("other", 8 * SLICE, shared=False)
        other.segment("other").array[:] = pattern(8 * SLICE, seed=5)
        config = client_config(num_rails=1, max_endpoints_per_rail=1)
        with TransferEngine(config) as client:
            first, second = np.zeros(8 * SLICE, np.uint8), np.zeros(8 * SLICE, np.uint8)
            client.transfer([TransferRequest(TransferOp.READ, first, desc),
                             TransferRequest(TransferOp.READ, second, other_desc),
                             TransferRequest(TransferOp.READ, first, desc)], timeout_s=30)
            assert client.endpoint_keys(0) == [EndpointKey(TransportKind.TCP, desc.address)]
    assert np.array_equal(first, engine.segment("dram").array[:8 * SLICE])
    assert np.array_equal(second, pattern(8 * SLICE, seed=5))


class ReorderingPeer:
    """A segment server stand-in on a real socket: takes `count` READ requests, then answers
    them in reverse order, with the reply of `corrupt_id` damaged after its digest was taken."""

    def __init__(self, count: int, corrupt_id: int | None = None, hang_up: bool = False) -> None:
        self.count, self.corrupt_id, self.hang_up = count, corrupt_id, hang_up
        self.listener = socket.socket()
        for port in range(20500, 20600):
            try:
                self.listener.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        self.listener.listen(1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def payload(request: Header) -> bytes:
        return bytes((request.offset + i) % 256 for i in range(request.length))

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn, self.listener:
            requests = [self._request(conn) for _ in range(self.count)]
            if self.hang_up:  # with every request unanswered
                return
            for request in reversed(requests):
                self._reply(conn, request)
            self._reply(conn, self._request(conn))  # then one more, in order

    @staticmethod
    def _request(conn: socket.socket) -> Header:
        header = bytearray(frame.HEADER_BYTES)
        recv_exactly(conn, memoryview(header))
        return frame.unpack(header)

    def _reply(self, conn: socket.socket, request: Header) -> None:
        body = bytearray(self.payload(request))
        digest = Digest(KIND)
        digest.update(body)
        if request.request_id == self.corrupt_id:
            body[3] ^= 0x10
        reply = Header(op=Op.READ | frame.REPLY, request_id=request.request_id,
                       length=len(body), flags=request.flags)
        conn.sendall(reply.pack() + bytes(body) + frame.TRAILER.pack(digest.value()))


def test_replies_out_of_order_are_matched_by_id_and_a_bad_one_fails_alone() -> None:
    peer = ReorderingPeer(count=4, corrupt_id=2)
    desc = SegmentDesc("remote", 1, 1 << 20, peer.address, "elsewhere")
    transport = TcpTransport.connect(peer.address, timeout_s=10)
    dests = {}
    for offset in (0, 100, 200, 300):
        dest = memoryview(bytearray(50))
        dests[transport.start_read(desc, offset, dest, checksum=KIND)] = (offset, dest)
    assert transport.num_outstanding == 4
    with pytest.raises(RuntimeError, match="outstanding"):
        transport.read(desc, 0, memoryview(bytearray(1)), checksum=None)
    done = [transport.next_completion() for _ in range(4)]
    assert [d.token for d in done] == [4, 3, 2, 1]
    for completion in done:
        offset, dest = dests[completion.token]
        if completion.token == 2:
            assert completion.error is not None and "checksum mismatch" in str(completion.error)
            assert completion.error.retryable and not completion.verified
        else:
            assert completion.error is None and completion.verified
            assert bytes(dest) == ReorderingPeer.payload(Header(op=Op.READ, offset=offset,
                                                                length=50))
    # the stream is still in step after the bad reply: the next read works
    again = memoryview(bytearray(8))
    assert transport.read(desc, 7, again, checksum=KIND) is not None
    assert bytes(again) == bytes(range(7, 15))
    with pytest.raises(RuntimeError, match="no operation is outstanding"):
        transport.next_completion()
    transport.close()
    peer.thread.join(timeout=10)


def test_a_lost_connection_loses_every_outstanding_read_and_says_so() -> None:
    peer = ReorderingPeer(count=3, hang_up=True)
    desc = SegmentDesc("remote", 1, 1 << 20, peer.address, "elsewhere")
    transport = TcpTransport.connect(peer.address, timeout_s=10)
    for offset in (0, 10, 20):
        transport.start_read(desc, offset, memoryview(bytearray(10)), checksum=KIND)
    with pytest.raises(TransportError, match="peer closed the connection") as info:
        transport.next_completion()
    assert info.value.retryable and transport.num_outstanding == 0
    with pytest.raises(TransportError, match="connection is closed"):
        transport.next_completion()
    with pytest.raises(TransportError, match="connection is closed"):
        transport.start_read(desc, 0, memoryview(bytearray(1)), checksum=None)
    peer.thread.join(timeout=10)


@pytest.mark.parametrize("op", [TransferOp.READ, TransferOp.WRITE])
def test_a_request_that_asks_for_a_tcp_checksum_gets_one_whatever_the_default(
        owner: tuple[TransferEngine, SegmentDesc], op: TransferOp) -> None:
    engine, desc = owner
    source = pattern(64 * SLICE, seed=4)
    for checksum, intact in ((True, True), (None, False)):
        engine.segment("dram").array[:] = source if op is TransferOp.READ else 0
        injected: dict[int, list[FaultyTransport]] = {}
        with TransferEngine(client_config(checksum_tcp=False), wrap_transport=faulty_rail_zero(
                FaultSpec(corrupt_rate=0.3), injected)) as client:
            buffer = np.zeros_like(source) if op is TransferOp.READ else source.copy()
            request = TransferRequest(op, buffer, desc, checksum_tcp=checksum)
            client.transfer([request], timeout_s=30)
        landed = buffer if op is TransferOp.READ else engine.segment("dram").array
        # with the engine's default (off on TCP) the flipped bytes land: nothing checks them
        assert np.array_equal(landed, source) is intact
        assert injected[0][0].num_corrupted > 0
