"""The wire header: round trip and every malformed field refused with the right status."""

from __future__ import annotations

import struct

import pytest

from kvcake.transfer import frame
from kvcake.transfer.checksum import ChecksumKind
from kvcake.transfer.frame import FrameError, Header, Op, Status


def test_header_round_trips() -> None:
    header = Header(op=Op.WRITE, segment_id=7, request_id=2**40, offset=123, length=4096,
                    checksum=2**63 + 5, flags=int(ChecksumKind.CRC32))
    data = header.pack()
    assert len(data) == frame.HEADER_BYTES == 44
    assert frame.unpack(data) == header
    assert frame.unpack(data).checksum_kind is ChecksumKind.CRC32


def raw(**fields: int) -> bytes:
    values = {"magic": frame.MAGIC, "version": frame.VERSION, "op": int(Op.READ), "flags": 0,
              "status": 0, "reserved": 0, "segment_id": 1, "checksum": 0, "request_id": 1,
              "offset": 0, "length": 8}
    values.update(fields)
    return frame.HEADER.pack(*values.values())


@pytest.mark.parametrize(("fields", "message"), [
    ({"magic": 0x1234}, "bad magic"),
    ({"version": 9}, "protocol version 9"),
    ({"flags": 0x03}, "unknown flags"),
    ({"op": 77}, "unknown op 77"),
])
def test_malformed_headers_are_bad_frames(fields: dict[str, int], message: str) -> None:
    with pytest.raises(FrameError, match=message) as info:
        frame.unpack(raw(**fields))
    assert info.value.status is Status.BAD_FRAME


def test_short_header_is_refused() -> None:
    with pytest.raises(FrameError, match="44 bytes"):
        frame.unpack(b"\x00" * 10)


def test_range_checks() -> None:
    frame.check_range(0, 16, 16)
    with pytest.raises(FrameError) as info:
        frame.check_range(8, 9, 16)
    assert info.value.status is Status.OUT_OF_RANGE
    with pytest.raises(FrameError) as info:
        frame.check_range(0, 0, 16)
    assert info.value.status is Status.ZERO_LENGTH


def test_error_reply_to_an_unreadable_frame_is_parseable() -> None:
    header, body = frame.error_reply(None, Status.BAD_FRAME, "x" * 10_000)
    parsed = frame.unpack(header.pack())
    assert parsed.op == Op.NONE | frame.REPLY and parsed.status == Status.BAD_FRAME
    assert len(body) == parsed.length == frame.MAX_ERROR_BYTES
    assert struct.calcsize("!HBBBBHIQQQQ") == frame.HEADER_BYTES
