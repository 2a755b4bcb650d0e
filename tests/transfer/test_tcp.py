"""TCP transport and segment server: round trips, and bad input that never stops the server."""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from kvcake.transfer import (
    SegmentDesc,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    TransportError,
    frame,
)
from kvcake.transfer.frame import Header, Op, Status
from kvcake.transfer.tcp import TcpTransport, parse_address, recv_exactly
from tests.net import refused_address


def pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_write_then_read_back_over_tcp(server: TransferEngine, client: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 64 * 1024)
    data = pattern(10_000)
    client.write(desc, 1000, data)
    assert np.array_equal(server.segment("dram").array[1000:11_000], data)
    out = bytearray(10_000)
    client.read(desc, 1000, out)
    assert bytes(out) == data.tobytes()
    # both rails carried slices (4 KiB slices, 3 per request) and hold one endpoint each
    assert client.endpoint_keys(0) == client.endpoint_keys(1) != []


def test_registered_numpy_torch_and_bytearray_segments(server: TransferEngine,
                                                       client: TransferEngine) -> None:
    import torch

    array = np.zeros(8192, np.uint8)
    tensor = torch.zeros(1024, dtype=torch.bfloat16)  # 2 KiB, reached through its storage
    raw = bytearray(100)
    descs = [server.register_segment("np", array), server.register_segment("pt", tensor),
             server.register_segment("ba", raw)]
    assert [d.length_bytes for d in descs] == [8192, 2048, 100]
    ones = torch.ones(1024, dtype=torch.bfloat16)
    client.write(descs[1], 0, ones)
    assert torch.equal(tensor, ones)
    client.write(descs[0], 8000, b"x" * 192)
    assert bytes(array[8000:]) == b"x" * 192
    client.write(descs[2], 99, b"!")
    assert raw[99:] == b"!"
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        server.register_segment("strided", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="request 0.buffer: tensor must be contiguous"):
        client.read(descs[0], 0, torch.zeros(4, 4).t())


def test_lookup_by_name(server: TransferEngine, client: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096, shared=False)
    assert client.lookup(server.address, "dram") == desc
    with pytest.raises(TransferError, match="no segment named 'nope'"):
        client.lookup(server.address, "nope")


def raw_socket(server: TransferEngine) -> socket.socket:
    host, port = parse_address(server.address)
    return socket.create_connection((host, port), timeout=10)


def reply_of(sock: socket.socket) -> tuple[Header, bytes]:
    header = bytearray(frame.HEADER_BYTES)
    recv_exactly(sock, memoryview(header))
    parsed = frame.unpack(header)
    body = bytearray(parsed.length)
    recv_exactly(sock, memoryview(body))
    return parsed, bytes(body)


def test_garbage_gets_an_error_and_only_that_connection_closes(server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096)
    with raw_socket(server) as bad:
        bad.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 26)
        reply, body = reply_of(bad)
        assert reply.status == Status.BAD_FRAME and b"bad magic" in body
        assert bad.recv(1) == b""  # closed
    transport = TcpTransport.connect(server.address)
    transport.ping()
    transport.write(desc, 0, memoryview(b"ok"), checksum=None, digest=None)
    transport.close()


@pytest.mark.parametrize(("header", "status", "text"), [
    (Header(op=Op.READ, segment_id=99, length=8), Status.UNKNOWN_SEGMENT, "unknown segment id 99"),
    (Header(op=Op.READ, segment_id=1, offset=4090, length=8), Status.OUT_OF_RANGE, "exceeds"),
    (Header(op=Op.READ, segment_id=1, length=0), Status.ZERO_LENGTH, "zero-length"),
    (Header(op=Op.WRITE, segment_id=1, offset=4095, length=2), Status.OUT_OF_RANGE, "exceeds"),
])
def test_bad_requests_get_errors_and_the_connection_keeps_serving(
        server: TransferEngine, header: Header, status: Status, text: str) -> None:
    desc = server.allocate_segment("dram", 4096)
    if header.segment_id == 1:
        header = dataclasses.replace(header, segment_id=desc.segment_id)
    with raw_socket(server) as sock:
        sock.sendall(header.pack() + b"\xff" * header.length * (header.op == Op.WRITE))
        reply, body = reply_of(sock)
        assert reply.status == status and text in body.decode()
        sock.sendall(Header(op=Op.READ, segment_id=desc.segment_id, offset=0, length=4).pack())
        reply, body = reply_of(sock)
        assert reply.status == Status.OK and body == b"\x00" * 4  # the rejected write wrote nothing


def test_write_with_a_wrong_checksum_is_refused(server: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096)
    transport = TcpTransport.connect(server.address)
    from kvcake.transfer.checksum import ChecksumKind

    with pytest.raises(TransportError, match="CHECKSUM_MISMATCH") as info:
        transport.write(desc, 0, memoryview(b"abc"), checksum=ChecksumKind.CRC32, digest=1)
    assert info.value.retryable
    transport.write(desc, 0, memoryview(b"abc"), checksum=ChecksumKind.CRC32,
                    digest=ChecksumKind.CRC32.compute(b"abc"))
    transport.close()
    assert bytes(server.segment("dram").array[:3]) == b"abc"


def test_remote_rejection_fails_the_request_without_retries(server: TransferEngine,
                                                             client: TransferEngine) -> None:
    desc = server.allocate_segment("dram", 4096)
    ghost = SegmentDesc(desc.name, 42, desc.length_bytes, desc.address, desc.host_id)
    status = client.wait(client.submit([TransferRequest(TransferOp.READ, bytearray(8), ghost)]))
    assert status.requests[0].error is not None
    assert "UNKNOWN_SEGMENT" in status.requests[0].error and "not retryable" in status.requests[0].error
    client.read(desc, 0, bytearray(8))  # the engine and server both still work


def test_unreachable_peer_fails_after_retries(client: TransferEngine) -> None:
    with refused_address() as dead:  # a fixed port may be some other run's server
        ghost = SegmentDesc("x", 1, 4096, dead, "elsewhere")
        with pytest.raises(TransferError, match="after 4 attempts.*cannot connect"):
            client.read(ghost, 0, bytearray(16), timeout_s=30)


def test_each_rail_binds_its_own_local_address(server: TransferEngine) -> None:
    from kvcake.transfer import TransferConfig

    desc = server.allocate_segment("dram", 16 * 1024)
    bound: dict[int, str] = {}

    def wrap(t, key, rail):  # type: ignore[no-untyped-def]
        assert isinstance(t, TcpTransport)
        bound[rail] = t.local_address.rpartition(":")[0]
        return t

    config = TransferConfig(serve=False, use_shared_memory=False, num_rails=2, slice_bytes=4096,
                            rail_bind_hosts=("127.0.0.2", "127.0.0.3"), inline_max_slices=0)
    with TransferEngine(config, wrap_transport=wrap) as client:
        client.write(desc, 0, b"y" * 8192)
    assert bound == {0: "127.0.0.2", 1: "127.0.0.3"}
    assert bytes(server.segment("dram").array[:8192]) == b"y" * 8192
