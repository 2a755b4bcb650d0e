"""Hostile bytes at a segment server: random and truncated frames, wrong magic and versions,
huge lengths, valid frames where they make no sense. Each connection gets error replies or is
closed; the server keeps serving a member that stays connected throughout, and not one byte of
its segment changes.

Generated examples never hold a well-formed WRITE inside the segment (that is a member's legal
write, not hostile input): writes go to unknown segments, out of range, with bad headers or
with their header cut short. A WRITE whose header is whole but whose payload is cut short does
land the bytes that arrived in its own range (writes are zero-copy; the range is undefined until
the WRITE's reply): `test_a_write_cut_short_is_never_acknowledged` pins that case separately.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvcake.transfer import SegmentDesc, TransferConfig, TransferEngine, frame
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.frame import Header, Op, Status
from kvcake.transfer.tcp import TcpTransport, parse_address

SEGMENT_BYTES = 64 << 10
PATTERN = bytes(range(256)) * (SEGMENT_BYTES // 256)
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class Served:
    """A segment server with one segment of PATTERN, and a member connected to it."""

    def __init__(self) -> None:
        self.engine = TransferEngine(TransferConfig(port=0, num_rails=1, io_timeout_s=5.0))
        self.engine.start()
        self.desc = self.engine.register_segment("kv", bytearray(PATTERN))
        self.member = TcpTransport.connect(self.desc.address, timeout_s=5.0)

    def still_serves(self) -> None:
        """The member's connection, opened before the fuzzing, still reads the right bytes."""
        self.member.ping()
        out = bytearray(4096)
        self.member.read(self.desc, 8192, memoryview(out), checksum=None)
        assert bytes(out) == PATTERN[8192:8192 + 4096]

    def unchanged(self) -> bool:
        return bytes(self.engine.segment("kv").view) == PATTERN

    def close(self) -> None:
        self.member.close()
        self.engine.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def exchange(desc: SegmentDesc, data: bytes) -> list[Header]:
    """Send `data` on a new connection, close our sending side, and read every reply header
    (skipping their payloads) until the server closes the connection."""
    replies: list[Header] = []
    with socket.create_connection(parse_address(desc.address), timeout=5.0) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first (it refused what came before)
            return replies
        stream = _read_all(sock)
    while len(stream) >= frame.HEADER_BYTES:
        reply = frame.unpack(stream[:frame.HEADER_BYTES])  # a malformed reply fails the test
        replies.append(reply)
        body = reply.length + (frame.TRAILER_BYTES if reply.flags and reply.status == 0 else 0)
        stream = stream[frame.HEADER_BYTES + body:]
    assert stream == b"" or len(stream) < frame.HEADER_BYTES
    return replies


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:  # closed with our bytes unread: a reset, same as a close
        pass
    return b"".join(chunks)


def is_member_write(header: bytes, desc: SegmentDesc) -> bool:
    """A well-formed WRITE inside the segment: a member's write, excluded from hostile input."""
    try:
        h = frame.unpack(header)
    except frame.FrameError:
        return False
    return (h.op == Op.WRITE and h.segment_id == desc.segment_id and h.length > 0
            and h.offset + h.length <= desc.length_bytes)


def raw_header(magic: int, version: int, op: int, flags: int, status: int, segment_id: int,
               offset: int, length: int) -> bytes:
    return frame.HEADER.pack(magic, version, op, flags, status, 0, segment_id, 0, 1, offset,
                             length)


u8, u16 = st.integers(0, 0xFF), st.integers(0, 0xFFFF)
u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
headers = st.one_of(
    st.builds(raw_header, u16, u8, u8, u8, u8, u32, u64, u64),  # anything at all
    st.builds(raw_header, st.just(frame.MAGIC), st.integers(0, 255).filter(
        lambda v: v != frame.VERSION), st.sampled_from(list(Op)), st.just(0), st.just(0),
        st.just(1), st.integers(0, 100), st.integers(1, 100)),  # wrong versions
    st.builds(raw_header, st.just(frame.MAGIC), st.just(frame.VERSION), u8, u8, u8, u32, u64,
              u64),  # right magic and version, anything else
    st.builds(raw_header, st.just(frame.MAGIC), st.just(frame.VERSION),
              st.sampled_from([Op.READ, Op.WRITE]), st.sampled_from([0, *map(int, ChecksumKind)]),
              st.just(0), st.integers(0, 3), st.integers(0, 2**64 - 1),
              st.integers(2**30, 2**64 - 1)),  # huge lengths
)


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes(served: Served, data: bytes) -> None:
    assume(not is_member_write(data[:frame.HEADER_BYTES], served.desc))
    for reply in exchange(served.desc, data):
        assert reply.status != Status.OK or reply.op in (Op.PING | frame.REPLY,
                                                          Op.READ | frame.REPLY)
    served.still_serves()
    assert served.unchanged()


@FUZZ
@given(header=headers, tail=st.binary(max_size=64), cut=st.integers(0, frame.HEADER_BYTES - 1),
       truncate=st.booleans())
def test_bad_and_truncated_headers(served: Served, header: bytes, tail: bytes, cut: int,
                                   truncate: bool) -> None:
    assume(not is_member_write(header, served.desc))
    data = header[:cut] if truncate else header + tail
    for reply in exchange(served.desc, data):
        try:
            asked = frame.unpack(header).op
        except frame.FrameError:
            asked = None
        assert reply.status != Status.OK or asked in (Op.PING, Op.READ), (asked, reply)
    served.still_serves()
    assert served.unchanged()


def _valid(op: int, **fields: int) -> bytes:
    return Header(op=op, request_id=7, **fields).pack()


OUT_OF_ORDER = [
    _valid(Op.READ | frame.REPLY, segment_id=1, length=16),  # a reply sent as a request
    _valid(Op.WRITE | frame.REPLY, length=0),
    _valid(Op.PING | frame.REPLY),
    _valid(Op.LOOKUP | frame.REPLY, length=4) + b"kv\0\0",
    _valid(Op.NONE),
    _valid(Op.LOOKUP, length=0),  # an empty name
    _valid(Op.LOOKUP, length=frame.MAX_NAME_BYTES + 1),
    _valid(Op.READ, segment_id=1, offset=0, length=0),  # zero length
]


def converse(desc: SegmentDesc, frames: list[bytes]) -> list[Header | None]:
    """Send the frames one at a time, each after the reply to the one before; the reply header
    to each (payload skipped), or None where the server closed the connection instead."""
    replies: list[Header | None] = []
    with socket.create_connection(parse_address(desc.address), timeout=5.0) as sock:
        for data in frames:
            try:
                sock.sendall(data)
                head = _recv_exactly(sock, frame.HEADER_BYTES)
            except OSError:
                head = None
            if head is None:
                replies.append(None)
                return replies
            reply = frame.unpack(head)
            _recv_exactly(sock, reply.length)
            replies.append(reply)
    return replies


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes | None:
    buf = b""
    while len(buf) < num_bytes:
        chunk = sock.recv(num_bytes - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


@FUZZ
@given(frames=st.lists(st.sampled_from(OUT_OF_ORDER), min_size=1, max_size=4),
       writes=st.lists(st.tuples(st.integers(0, 2 * SEGMENT_BYTES), st.integers(1, 4096),
                                 st.integers(2, 9)), max_size=3))
def test_valid_frames_out_of_order(served: Served, frames: list[bytes],
                                   writes: list[tuple[int, int, int]]) -> None:
    """Reply ops as requests, empty names, zero lengths, and writes to segments that do not
    exist or past the end: each is answered with an error, and the connection goes on after
    every one but a frame the server cannot trust (BAD_FRAME: then it closes); nothing is
    written."""
    assume(all(segment_id != served.desc.segment_id for _, _, segment_id in writes))
    sent = [_valid(Op.WRITE, segment_id=segment_id, offset=offset, length=length)
            + b"\xAA" * length for offset, length, segment_id in writes]
    sent += frames
    sent.append(_valid(Op.WRITE, segment_id=served.desc.segment_id, offset=SEGMENT_BYTES - 8,
                       length=16) + b"\xBB" * 16)  # past the end
    replies = converse(served.desc, sent)
    for i, reply in enumerate(replies):
        assert reply is not None, f"closed without an answer to frame {i}"
        assert reply.status != Status.OK
        if reply.status == Status.BAD_FRAME:  # the server closes after it
            assert i == len(replies) - 1 or replies[i + 1] is None
            break
    else:
        assert len(replies) == len(sent)
    served.still_serves()
    assert served.unchanged()


def test_a_write_cut_short_is_never_acknowledged(served: Served) -> None:
    """Only the addressed range may hold what arrived; no reply acknowledges it; the rest of
    the segment and the server are untouched."""
    header = _valid(Op.WRITE, segment_id=served.desc.segment_id, offset=1000, length=4096)
    assert exchange(served.desc, header + b"\xCC" * 100) == []
    view = served.engine.segment("kv").view
    assert bytes(view[1000:1100]) == b"\xCC" * 100
    assert bytes(view[:1000]) == PATTERN[:1000] and bytes(view[1100:]) == PATTERN[1100:]
    view[1000:1100] = PATTERN[1000:1100]  # restore for the other tests
    served.still_serves()


def test_the_examples_can_fail() -> None:
    """The checks above see a change: a member's write is excluded as hostile input."""
    desc = SegmentDesc("kv", 1, 4096, "127.0.0.1:1", host_id="h")
    assert is_member_write(_valid(Op.WRITE, segment_id=1, offset=0, length=10), desc)
    assert not is_member_write(_valid(Op.WRITE, segment_id=1, offset=4090, length=10), desc)
    assert struct.calcsize("!HBBBBHIQQQQ") == frame.HEADER_BYTES
