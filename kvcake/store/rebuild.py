"""Rebuilding a new master's metadata from what its nodes hold (store-master failover).

Each node keeps the catalogue of the committed objects in its DRAM segment (the master tells it
with one-way `hold` / `forget` frames, see `MasterService(mirror=True)`), checks each entry
against the bytes in its segment (header version and payload checksum), and re-registers with
the new leader with that list. `adopt` turns one node's list into committed objects with one DRAM
replica on it, at the same offset and version, so clients read the same bytes. Pure.

An entry: [key, offset, alloc_bytes, version, size_bytes, checksum].
"""

from __future__ import annotations

import logging
from typing import Any

from kvcake.store.errors import InvalidRequest
from kvcake.store.index import StoreIndex
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.objects import ObjectMeta, Replica, Tier

log = logging.getLogger(__name__)

Entry = tuple[str, int, int, int, int, int]


def parse_entry(item: Any) -> Entry:
    """One catalogue entry, checked; InvalidRequest naming the field otherwise."""
    if not (isinstance(item, list | tuple) and len(item) == 6 and isinstance(item[0], str)
            and item[0] and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                for v in item[1:])):
        raise InvalidRequest("objects: each must be [key, offset, alloc_bytes, version, "
                             "size_bytes, checksum] with non-negative integers")
    key, offset, alloc_bytes, version, size_bytes, checksum = item
    if alloc_bytes < size_bytes + HEADER_BYTES:
        raise InvalidRequest(f"objects: {key!r} alloc_bytes {alloc_bytes} cannot hold "
                             f"{size_bytes} bytes and the header")
    return key, offset, alloc_bytes, version, size_bytes, checksum


def adopt(index: StoreIndex, node_id: str, items: list[Any], now_s: float) -> int:
    """Add the committed objects `items` that the registered node `node_id` holds; returns how
    many replicas were adopted. An entry that clashes (its range taken, or the key known with
    another size or checksum) is skipped and logged: the rest still count."""
    node = index.nodes.get(node_id)
    if node is None:
        raise InvalidRequest(f"node_id: {node_id!r} must register before its objects")
    adopted = 0
    max_version = 0
    for item in items:
        key, offset, alloc_bytes, version, size_bytes, checksum = parse_entry(item)
        meta = index.objects.get(key)
        if meta is not None and (not meta.committed or meta.size_bytes != size_bytes
                                 or meta.checksum != checksum):
            log.warning("node %s holds %r unlike the copy already adopted: skipped", node_id, key)
            continue
        if meta is not None and any(r.node_id == node_id for r in meta.replicas):
            continue
        try:
            node.allocator.reserve(offset, alloc_bytes)
        except ValueError as exc:
            log.warning("node %s: %r not adopted (%s)", node_id, key, exc)
            continue
        replica = Replica(node_id, Tier.DRAM, offset, alloc_bytes, version, complete=True)
        if meta is None:
            index.objects[key] = ObjectMeta(key, size_bytes, checksum, [replica], committed=True)
        else:
            meta.replicas.append(replica)
        index.lru.touch(key)
        adopted += 1
        max_version = max(max_version, version)
    index.space.raise_version_floor(max_version + 1)
    return adopted
