"""The wire format between a transfer client and a segment server. Pure: bytes in, values out.

Every message starts with one fixed 44-byte header (network byte order):

    magic u16 | version u8 | op u8 | flags u8 | status u8 | reserved u16 |
    segment_id u32 | checksum u64 | request_id u64 | offset u64 | length u64

and is followed by `length` payload bytes where the op has a payload:
    READ    -> (no payload)           reply READ|REPLY + `length` data bytes
    WRITE   -> `length` data bytes    reply WRITE|REPLY, length 0
    LOOKUP  -> segment name (utf-8)   reply LOOKUP|REPLY + msgpack descriptor
    PING    -> (no payload)           reply PING|REPLY
An error reply has status != OK and a utf-8 message as its payload. `flags` names at most one
checksum algorithm (a ChecksumKind bit): a READ asks for it, a WRITE announces it. The data's
sender then follows the data with an 8-byte digest TRAILER (READ|REPLY and WRITE carry `length`
data bytes + 8); the receiver checks it before trusting the bytes. A trailer rather than the
header's `checksum` field (0 in version 2) lets the sender digest each chunk (CHUNK_BYTES) just
before sending it, and the receiver just after receiving it, while the chunk is in cache, and lets
a writer's transport digest the bytes itself as it sends them.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvcake.transfer.checksum import ChecksumKind

MAGIC = 0x4B54  # "KT"
VERSION = 2
HEADER = struct.Struct("!HBBBBHIQQQQ")
HEADER_BYTES = HEADER.size
TRAILER = struct.Struct("!Q")
TRAILER_BYTES = TRAILER.size
CHUNK_BYTES = 4 << 20  # digested then sent (received then digested) at a time; see tcp.send_digested
REPLY = 0x80
MAX_NAME_BYTES = 1024
MAX_ERROR_BYTES = 4096


class Op(enum.IntEnum):
    NONE = 0  # only in the error reply to a frame whose op could not be read
    READ = 1
    WRITE = 2
    LOOKUP = 3
    PING = 4


class Status(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1  # magic, version, flags or op not understood: the stream is closed after
    UNKNOWN_SEGMENT = 2
    OUT_OF_RANGE = 3
    ZERO_LENGTH = 4
    CHECKSUM_MISMATCH = 5
    INTERNAL = 6
    BAD_CHECKSUM_KIND = 7  # the asked algorithm is not installed on the server


# Faults of the path that another rail may not have; the rest reject the request itself.
RETRYABLE = frozenset({Status.CHECKSUM_MISMATCH, Status.INTERNAL})


class FrameError(ValueError):
    """A header that cannot be parsed: `status` says what to reply."""

    def __init__(self, message: str, status: Status = Status.BAD_FRAME) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Header:
    op: int  # an Op, or'ed with REPLY in replies
    segment_id: int = 0
    request_id: int = 0
    offset: int = 0
    length: int = 0
    checksum: int = 0
    flags: int = 0
    status: int = Status.OK

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.op, self.flags, self.status, 0, self.segment_id,
                           self.checksum, self.request_id, self.offset, self.length)

    @property
    def checksum_kind(self) -> ChecksumKind | None:
        return ChecksumKind(self.flags) if self.flags else None


def unpack(data: bytes | bytearray | memoryview) -> Header:
    """Parse and check the fixed fields of one header; FrameError on anything malformed."""
    if len(data) != HEADER_BYTES:
        raise FrameError(f"header must be {HEADER_BYTES} bytes, got {len(data)}")
    (magic, version, op, flags, status, _reserved, segment_id, checksum, request_id, offset,
     length) = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic 0x{magic:04x} (expected 0x{MAGIC:04x}): not a kvcake transfer peer")
    if version != VERSION:
        raise FrameError(f"protocol version {version} not supported (this side speaks {VERSION})")
    if flags and flags not in ChecksumKind._value2member_map_:
        raise FrameError(f"unknown flags 0x{flags:02x} (at most one checksum bit may be set)")
    if op & ~REPLY not in Op._value2member_map_:
        raise FrameError(f"unknown op {op}")
    return Header(op=op, segment_id=segment_id, request_id=request_id, offset=offset,
                  length=length, checksum=checksum, flags=flags, status=status)


def check_range(offset: int, length: int, segment_length: int) -> None:
    """FrameError unless [offset, offset + length) is a non-empty range inside the segment."""
    if length == 0:
        raise FrameError("zero-length transfer", Status.ZERO_LENGTH)
    if offset + length > segment_length:
        raise FrameError(f"range [{offset}, {offset + length}) exceeds segment length "
                         f"{segment_length}", Status.OUT_OF_RANGE)


def error_reply(request: Header | None, status: Status, message: str) -> tuple[Header, bytes]:
    body = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
    op = (request.op if request is not None else Op.NONE) | REPLY
    return Header(op=op, request_id=request.request_id if request else 0, length=len(body),
                  status=status), body
