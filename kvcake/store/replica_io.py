"""The transfer requests that write and read one object's replicas, and the check of a read.

A replica is a header and the payload behind it (see layout.py); these helpers turn a replica
descriptor from the master into requests for the transfer engine, and say whether what a read
brought back is exactly the object the master described.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcake.store.errors import InvalidRequest
from kvcake.store.layout import HEADER_BYTES, CorruptObject, pack_header, verify
from kvcake.transfer import SegmentDesc, TransferOp, TransferRequest

log = logging.getLogger(__name__)

JOIN_BYTES = 256 << 10  # objects up to this size are written with their header in one request
# A put's bytes that cross TCP always carry a digest, whatever the engine's default: the node
# checks them as they land, so a put corrupted on the way fails rather than commits (the
# payload's digest is its object checksum, computed anyway).
CHECKED = True


_SEGMENTS: dict[tuple[Any, ...], SegmentDesc] = {}
_MAX_SEGMENTS = 1024  # distinct segment descriptors remembered (one per node in a cluster)


def segment_of(values: dict[str, Any]) -> SegmentDesc:
    """`SegmentDesc.from_dict` of a replica's segment, built once per distinct descriptor (every
    descriptor the master hands out for a node repeats the same few fields)."""
    key = tuple(values.items())
    try:
        segment = _SEGMENTS.get(key)
    except TypeError:  # an unhashable field: not a descriptor a node sends; let from_dict judge
        return SegmentDesc.from_dict(values)
    if segment is None:
        segment = SegmentDesc.from_dict(values)
        if len(_SEGMENTS) >= _MAX_SEGMENTS:
            _SEGMENTS.clear()
        _SEGMENTS[key] = segment
    return segment


def write_requests(view: memoryview, checksum: int,
                   descs: list[dict[str, Any]]) -> list[TransferRequest]:
    """Header + payload into every replica; small objects as one request (copying is cheaper
    than a second slice). Each asks for a digest where it crosses TCP (`CHECKED`)."""
    requests = []
    for desc in descs:
        segment = segment_of(desc["segment"])
        header = pack_header(checksum, desc["version"], len(view))
        if len(view) <= JOIN_BYTES:
            requests.append(TransferRequest(TransferOp.WRITE, header + view, segment,
                                            desc["offset"], checksum_tcp=CHECKED))
            continue
        requests.append(TransferRequest(TransferOp.WRITE, header, segment, desc["offset"],
                                        checksum_tcp=CHECKED))
        requests.append(TransferRequest(TransferOp.WRITE, view, segment,
                                        desc["offset"] + HEADER_BYTES, checksum_tcp=CHECKED))
    return requests


def check_room(key: str, meta: dict[str, Any], dest: memoryview) -> None:
    """InvalidRequest unless `dest` can hold the object."""
    if len(dest) < meta["size_bytes"]:
        raise InvalidRequest(f"buffer: {len(dest)} bytes cannot hold {key!r} of "
                             f"{meta['size_bytes']} bytes")


def read_requests(replica: dict[str, Any], meta: dict[str, Any], header: bytearray | memoryview,
                  dest: memoryview) -> list[TransferRequest]:
    """The header into `header`, the payload into `dest` (two requests: `dest` is the caller's)."""
    segment = segment_of(replica["segment"])
    requests = [TransferRequest(TransferOp.READ, header, segment, replica["offset"])]
    size = int(meta["size_bytes"])
    if size:
        requests.append(TransferRequest(TransferOp.READ, dest, segment,
                                        replica["offset"] + HEADER_BYTES, size))
    return requests


def valid(replica: dict[str, Any], meta: dict[str, Any], header: bytearray | memoryview,
          dest: memoryview) -> bool:
    """True if `header` + `dest` hold exactly object `meta` as this replica's version."""
    try:
        verify(header, dest[:meta["size_bytes"]], replica["version"], meta["checksum"])
        return True
    except CorruptObject as exc:
        log.warning("replica of version %d on %s rejected: %s", replica["version"],
                    replica["node_id"], exc)
        return False
