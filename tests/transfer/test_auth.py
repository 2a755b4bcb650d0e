"""Segment servers with a cluster secret: the right one is served, a wrong one or none is
refused before any byte of a segment is read or written, and other clients never notice."""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Iterator

import pytest

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.transfer import TransferConfig, TransferEngine, TransferError, frame
from kvcake.transfer.frame import Header, Op
from kvcake.transfer.tcp import parse_address

SECRET = ClusterSecret.from_text("cluster-secret-for-tests-0123456789")
WRONG = ClusterSecret.from_text("not-the-cluster-secret-0123456789ab")
SERVER = TransferConfig(port=0, num_rails=1, io_timeout_s=5.0, secret=SECRET)
CLIENT = TransferConfig(serve=False, use_shared_memory=False, num_rails=1, io_timeout_s=5.0,
                        max_retries=1, inline_max_slices=0)


@pytest.fixture
def server() -> Iterator[TransferEngine]:
    with TransferEngine(SERVER) as engine:
        yield engine


def _client(secret: ClusterSecret | None) -> TransferEngine:
    """A TCP-only client engine (started by `with`)."""
    return TransferEngine(dataclasses.replace(CLIENT, secret=secret))


def test_the_right_secret_is_served(server: TransferEngine) -> None:
    desc = server.allocate_segment("kv", 8192)
    with _client(SECRET) as client:
        client.write(desc, 100, b"abc" * 100)
        out = bytearray(300)
        client.read(desc, 100, out)
        assert bytes(out) == b"abc" * 100
        assert client.lookup(desc.address, "kv") == desc


@pytest.mark.parametrize("secret, needle", [(WRONG, "wrong cluster secret"),
                                            (None, "requires the cluster secret")])
def test_a_wrong_or_missing_secret_is_refused_and_changes_nothing(
        server: TransferEngine, secret: ClusterSecret | None, needle: str,
        caplog: pytest.LogCaptureFixture) -> None:
    desc = server.allocate_segment("kv", 8192)
    view = server.segment("kv").view
    view[:] = b"\x07" * 8192
    with _client(secret) as intruder, _client(SECRET) as member, \
            caplog.at_level(logging.WARNING, "kvcake.transfer.server"):
        with pytest.raises(TransferError, match=needle):
            intruder.write(desc, 0, b"\xff" * 4096)
        with pytest.raises(TransferError, match=needle):
            intruder.read(desc, 0, bytearray(4096))
        member.write(desc, 4096, b"\x01" * 16)  # the members' traffic goes on meanwhile
    assert bytes(view[:4096]) == b"\x07" * 4096 and bytes(view[4096:4112]) == b"\x01" * 16
    assert "refused a kvcake/segment/1 connection" in caplog.text


def test_a_raw_write_without_the_handshake_touches_nothing(server: TransferEngine) -> None:
    desc = server.allocate_segment("kv", 8192)
    view = server.segment("kv").view
    request = Header(op=Op.WRITE, segment_id=desc.segment_id, offset=0, length=4096,
                     request_id=1)
    with socket.create_connection(parse_address(desc.address), timeout=5.0) as sock:
        sock.sendall(request.pack() + b"\xee" * 4096)  # ignores the hello, writes at once
        hello = sock.recv(auth.HELLO_BYTES)
        assert auth.is_hello(hello)
        try:  # the server closes this connection (a reset: it left our bytes unread)
            assert sock.recv(4096) == b""
        except ConnectionResetError:
            pass
    assert bytes(view[:4096]) == b"\x00" * 4096
    with _client(SECRET) as member:  # and keeps serving the members
        member.write(desc, 0, b"\x02" * 8)
    assert bytes(view[:8]) == b"\x02" * 8
    assert frame.HEADER_BYTES < auth.HELLO_BYTES  # a client without a secret reads a hello


def test_the_secret_must_be_a_cluster_secret() -> None:
    with pytest.raises(ValueError, match="ClusterSecret.load"):
        TransferConfig(secret="plain text")  # type: ignore[arg-type]
    assert "hidden" in repr(SERVER) and SECRET.text() not in repr(SERVER)
