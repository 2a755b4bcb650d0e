"""Layout of one stored object in a segment: a fixed header, then the payload.

    offset                       offset + HEADER_BYTES          offset + HEADER_BYTES + size
    | magic u32 | crc32 u32 | version u64 | size u64 | pad u64 | payload ................... |

The version is unique per allocation (the master never reuses one), so a reader holding an old
descriptor detects that the range was reused by another object: a header with another version is
stale, whatever the payload. The crc32 of the payload is checked on every read.
"""

from __future__ import annotations

import struct
import zlib

try:  # ISA-L's crc32 is the same function as zlib's, 4-10x faster (vectorised carry-less multiply)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the portable fallback
    _crc32 = zlib.crc32

MAGIC = 0x4B564341  # "KVCA"
_HEADER = struct.Struct("<IIQQQ")
HEADER_BYTES = _HEADER.size  # 32


class CorruptObject(Exception):
    """The bytes read do not match the object's header, version or checksum."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    return _crc32(data) & 0xFFFFFFFF


def pack_header(crc: int, version: int, size_bytes: int) -> bytes:
    return _HEADER.pack(MAGIC, crc, version, size_bytes, 0)


def read_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(crc, version, size_bytes) of a header; CorruptObject if it is not one."""
    if len(data) < HEADER_BYTES:
        raise CorruptObject("range shorter than an object header")
    magic, crc, version, size_bytes, _ = _HEADER.unpack(bytes(data[:HEADER_BYTES]))
    if magic != MAGIC:
        raise CorruptObject("bad magic: the range does not hold a store object")
    return crc, version, size_bytes


def verify(header: bytes | bytearray | memoryview, payload: memoryview, version: int,
           crc: int) -> None:
    """Raise CorruptObject unless `header` + `payload` are exactly the object `version` with
    checksum `crc`."""
    head_crc, head_version, head_size = read_header(header)
    if head_version != version:
        raise CorruptObject(f"stale replica: version {head_version}, expected {version}")
    if head_size != len(payload) or head_crc != crc:
        raise CorruptObject("header does not match the object's size or checksum")
    if checksum(payload) != crc:
        raise CorruptObject("checksum mismatch: the payload is corrupted")
