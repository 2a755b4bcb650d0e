"""Engine behaviour: retries on other rails, failures, status and timeouts, bad requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvcake.transfer import (
    EndpointKey,
    FaultSpec,
    FaultyTransport,
    RequestState,
    SegmentDesc,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferTimeout,
    Transport,
)
from tests.transfer.conftest import SERVER_CONFIG, TCP_CLIENT_CONFIG


class Recording:
    """Wraps a transport and logs (rail, remote offset) of every slice that got through."""

    def __init__(self, inner: Transport, rail: int, log: list[tuple[int, int]]) -> None:
        self.inner, self.rail, self.log = inner, rail, log

    def read(self, segment, offset, dest, *, checksum):  # type: ignore[no-untyped-def]
        digest = self.inner.read(segment, offset, dest, checksum=checksum)
        self.log.append((self.rail, offset))
        return digest

    def write(self, segment, offset, src, *, checksum, digest):  # type: ignore[no-untyped-def]
        self.inner.write(segment, offset, src, checksum=checksum, digest=digest)
        self.log.append((self.rail, offset))

    def close(self) -> None:
        self.inner.close()


def engine_with(wrap, **changes) -> TransferEngine:  # type: ignore[no-untyped-def]
    values = {**TCP_CLIENT_CONFIG.__dict__, **changes}
    return TransferEngine(TransferConfig(**values), wrap_transport=wrap)


@pytest.fixture
def dram(server: TransferEngine) -> Iterator[SegmentDesc]:
    desc = server.allocate_segment("dram", 64 * 1024)
    server.segment("dram").array[:] = np.arange(64 * 1024) % 251
    yield desc


def test_slices_of_a_dead_rail_are_retried_on_the_other(dram: SegmentDesc) -> None:
    log: list[tuple[int, int]] = []

    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        dead = FaultSpec(drop_rate=1.0 if rail == 0 else 0.0)
        return Recording(FaultyTransport(t, dead, seed=rail), rail, log)

    with engine_with(wrap) as client:
        out = bytearray(4 * 4096)
        client.read(dram, 0, out)
    assert bytes(out) == (np.arange(4 * 4096) % 251).astype(np.uint8).tobytes()
    # slices 0 and 2 were dealt to rail 0, dropped there, and retried on rail 1
    assert sorted(log) == [(1, 0), (1, 4096), (1, 8192), (1, 12288)]


def test_a_slice_failing_everywhere_fails_its_request_with_a_clear_error(
        dram: SegmentDesc) -> None:
    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        return FaultyTransport(t, FaultSpec(drop_rate=1.0), seed=rail)

    with engine_with(wrap, max_retries=2) as client:
        batch = client.submit([TransferRequest(TransferOp.READ, bytearray(100), dram)])
        status = client.wait(batch, timeout_s=30)
        assert status.requests[0].state is RequestState.FAILED
        with pytest.raises(TransferError, match=r"request 0: slice \[0, \+100\) failed after 3 "
                                                r"attempts: injected drop"):
            status.raise_for_failure()


def test_preferred_rails_carry_the_slices(dram: SegmentDesc) -> None:
    log: list[tuple[int, int]] = []
    with engine_with(lambda t, key, rail: Recording(t, rail, log), num_rails=3) as client:
        client.set_rail_preference("dram", preferred=[2], secondary=[0])
        client.read(dram, 0, bytearray(3 * 4096))
        with pytest.raises(ValueError, match=r"rails \[3\] do not exist"):
            client.set_rail_preference("dram", preferred=[3])
    assert sorted(log) == [(2, 0), (2, 4096), (2, 8192)]


def test_status_is_pending_until_the_slices_move_and_wait_times_out(dram: SegmentDesc) -> None:
    hold = threading.Event()

    def wrap(t: Transport, key: EndpointKey, rail: int) -> Transport:
        return FaultyTransport(t, FaultSpec(hold=hold))

    with engine_with(wrap) as client:
        out = bytearray(10_000)
        batch = client.submit([TransferRequest(TransferOp.READ, out, dram, 0, 10_000)])
        status = client.status(batch)
        assert status.requests[0].state is RequestState.PENDING and status.bytes_done == 0
        with pytest.raises(TransferTimeout, match="not finished after 0.05 s"):
            client.wait(batch, timeout_s=0.05)
        hold.set()
        status = client.wait(batch, timeout_s=30)
        assert status.succeeded and status.requests[0].bytes_done == 10_000
        with pytest.raises(KeyError, match="already waited on"):
            client.status(batch)


def test_requests_of_a_batch_finish_independently(dram: SegmentDesc, server: TransferEngine) -> None:
    with engine_with(None) as client:
        good = TransferRequest(TransferOp.READ, bytearray(8), dram, 0)
        gone = SegmentDesc("gone", 77, 4096, server.address, dram.host_id)
        bad = TransferRequest(TransferOp.READ, bytearray(8), gone, 0)
        status = client.wait(client.submit([good, bad, good]), timeout_s=30)
    assert [r.state for r in status.requests] == [RequestState.DONE, RequestState.FAILED,
                                                  RequestState.DONE]
    assert [r.bytes_done for r in status.requests] == [8, 0, 8]


@pytest.mark.parametrize(("request_args", "message"), [
    ((TransferOp.READ, bytearray(8), None, 0, 0), "length must be positive"),
    ((TransferOp.READ, bytearray(8), None, 65_530), r"remote range \[65530, 65538\) is outside"),
    ((TransferOp.READ, bytearray(8), None, -1), "remote range"),
    ((TransferOp.WRITE, bytearray(8), None, 0, 16), "buffer holds 8 bytes, less than length 16"),
    ((TransferOp.READ, b"immutable", None, 0), "writable destination"),
    ((TransferOp.READ, np.zeros((4, 4))[:, 0], None, 0), "C-contiguous"),
    ((TransferOp.READ, object(), None, 0), "is not a buffer"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_working(
        dram: SegmentDesc, client: TransferEngine, request_args: tuple, message: str) -> None:
    op, buffer, _, *rest = request_args
    with pytest.raises(ValueError, match=message):
        client.submit([TransferRequest(op, buffer, dram, *rest)])
    client.write(dram, 0, b"still fine")
    out = bytearray(10)
    client.read(dram, 0, out)
    assert out == b"still fine"


def test_misuse_of_the_engine(server: TransferEngine, dram: SegmentDesc) -> None:
    with pytest.raises(RuntimeError, match="not started"):
        TransferEngine(TCP_CLIENT_CONFIG).submit([])
    with pytest.raises(ValueError, match="already registered"):
        server.allocate_segment("dram", 10)
    with pytest.raises(ValueError, match="zero length"):
        server.register_segment("empty", bytearray())
    with pytest.raises(KeyError, match="no local segment named 'nope'"):
        server.local_view("nope")
    with pytest.raises(ValueError, match=r"window \[0, 70000\)"):
        server.local_view("dram", 0, 70_000)
    with engine_with(None) as client:
        with pytest.raises(ValueError, match="at least one request"):
            client.submit([])
        no_address = SegmentDesc("x", 1, 10, "", "other-host")
        with pytest.raises(ValueError, match="no server address"):
            client.read(no_address, 0, bytearray(1))


def test_endpoint_pool_is_bounded_per_rail(dram: SegmentDesc) -> None:
    with TransferEngine(SERVER_CONFIG) as other, engine_with(None, num_rails=1,
                                                             max_endpoints_per_rail=1) as client:
        far = other.allocate_segment("far", 4096)
        client.read(dram, 0, bytearray(8))
        assert client.endpoint_keys(0) == [EndpointKey(dram_kind(), dram.address)]
        client.read(far, 0, bytearray(8))
        assert client.endpoint_keys(0) == [EndpointKey(dram_kind(), far.address)]
        client.read(dram, 0, bytearray(8))  # reconnects after eviction
        assert client.endpoint_keys(0) == [EndpointKey(dram_kind(), dram.address)]


def dram_kind():  # type: ignore[no-untyped-def]
    from kvcake.transfer import TransportKind

    return TransportKind.TCP


def test_a_peer_that_never_answers_times_out_each_attempt() -> None:
    import socket

    silent = socket.socket()
    for port in range(20500, 20600):
        try:
            silent.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    silent.listen(8)  # accepts connections (kernel backlog) but never replies
    try:
        desc = SegmentDesc("x", 1, 4096, f"127.0.0.1:{silent.getsockname()[1]}", "elsewhere")
        with engine_with(None, io_timeout_s=0.2, max_retries=1) as client:
            batch = client.submit([TransferRequest(TransferOp.READ, bytearray(8), desc)])
            status = client.wait(batch, timeout_s=30)
        assert status.requests[0].state is RequestState.FAILED
        assert "failed after 2 attempts" in (status.requests[0].error or "")
        assert "timed out" in (status.requests[0].error or "")
    finally:
        silent.close()
