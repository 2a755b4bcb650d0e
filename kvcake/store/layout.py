"""Layout of one stored object in a segment: a fixed header, then the payload.

    offset                            offset + HEADER_BYTES        offset + HEADER_BYTES + size
    | magic u32 | flags u32 | version u64 | size u64 | checksum u64 | payload .............. |

The version is unique per allocation (the master never reuses one), so a reader holding an old
descriptor detects that the range was reused by another object: a header with another version is
stale, whatever the payload. The payload's checksum (xxh3-64) is checked on every read.

`flags` is 0 when written. The node sets `REVOKED` in place (`revoke`, only if the header still
holds the version named) when the master drops that replica (remove, eviction, fewer replicas, its
node leaving), before the master answers the request that dropped it. A read through a
location a client remembered, which holds no lease, requires the flag clear (`verify(live=True)`):
once the master has acknowledged a remove, no remembered location serves the object. A read
under a lease ignores the flag: its range is not reused while the lease runs.

Why xxh3-64 and not crc32: it is ~3x faster (30 us per MiB here against ISA-L crc32's 85 us;
zlib's takes 300 us), and every get and put computes one over the whole object on the critical
path; 64 bits also make an undetected corruption far less likely than 32. `xxhash` is a declared
dependency: every writer and reader must use the same function, so there is no fallback.
"""

from __future__ import annotations

import struct

from xxhash import xxh3_64_intdigest

MAGIC = 0x4B564333  # "KVC3": the xxh3-64 layout
_HEADER = struct.Struct("<IIQQQ")
HEADER_BYTES = _HEADER.size  # 32


REVOKED = 1  # flags bit: the master dropped this replica (see the module docstring)
_FLAGS = struct.Struct("<I")
_VERSION = struct.Struct("<Q")


class CorruptObject(Exception):
    """The bytes read do not match the object's header, version or checksum."""


class RevokedObject(CorruptObject):
    """The replica was dropped by the master (its header carries `REVOKED`): not a corruption."""


def payload_checksum(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 digest the store keeps for a payload (an unsigned 64-bit int)."""
    digest: int = xxh3_64_intdigest(data)
    return digest


def pack_header(checksum: int, version: int, size_bytes: int) -> bytes:
    return _HEADER.pack(MAGIC, 0, version, size_bytes, checksum)


def revoke(segment: memoryview, offset: int, version: int) -> bool:
    """Set `REVOKED` in the header at `offset` if it holds object `version` (a range reused by
    a newer object is left alone); True if it did."""
    if offset < 0 or offset + HEADER_BYTES > len(segment):
        return False
    (magic,) = _FLAGS.unpack_from(segment, offset)
    (head_version,) = _VERSION.unpack_from(segment, offset + 8)
    if magic != MAGIC or head_version != version:
        return False
    (flags,) = _FLAGS.unpack_from(segment, offset + 4)
    _FLAGS.pack_into(segment, offset + 4, flags | REVOKED)
    return True


def is_revoked(header: bytes | bytearray | memoryview) -> bool:
    return len(header) >= 8 and bool(_FLAGS.unpack_from(header, 4)[0] & REVOKED)


def read_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(checksum, version, size_bytes) of a header; CorruptObject if it is not one."""
    if len(data) < HEADER_BYTES:
        raise CorruptObject("range shorter than an object header")
    magic, _, version, size_bytes, checksum = _HEADER.unpack(bytes(data[:HEADER_BYTES]))
    if magic != MAGIC:
        raise CorruptObject("bad magic: the range does not hold a store object")
    return checksum, version, size_bytes


def verify(header: bytes | bytearray | memoryview, payload: memoryview, version: int,
           checksum: int, live: bool = False) -> None:
    """Raise CorruptObject unless `header` + `payload` are exactly the object `version` with
    payload checksum `checksum`; with `live`, RevokedObject if the replica was revoked."""
    head_checksum, head_version, head_size = read_header(header)
    if head_version != version:
        raise CorruptObject(f"stale replica: version {head_version}, expected {version}")
    if live and is_revoked(header):
        raise RevokedObject(f"replica version {version} was revoked (removed or evicted)")
    if head_size != len(payload) or head_checksum != checksum:
        raise CorruptObject("header does not match the object's size or checksum")
    if payload_checksum(payload) != checksum:
        raise CorruptObject("checksum mismatch: the payload is corrupted")
