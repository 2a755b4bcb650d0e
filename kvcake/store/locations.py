"""`LocationCache`: where the objects a client wrote or read live, read without the master.

The cache remembers where each object this client wrote or read lives (size, checksum, replica
version and offset; up to `entries` keys), and the reader (reader.py) reads a remembered key's
replica straight away, without asking the master: one round trip instead of two.
Only replicas the master describes as `revocable` are remembered: their node marks a replica's
header revoked before the master answers the request that dropped it (a remove, an eviction, a
drop to fewer replicas, the node leaving; master.py). A remembered read is checked like any other
(the header must carry the remembered version, the payload the remembered checksum) and, since it
holds no lease, also that its header is not revoked (`verify(live=True)`); any failure drops the
entry and the get goes to the master as usual. So a read served from a remembered location is
linearizable with removes and overwrites by any client: once a remove is acknowledged, no
remembered location serves the removed object; a range reused by a new object carries a new
version. A location whose header a read through the master found revoked is not remembered.
Cached reads are told to the master (one-way `touch`, merged and sent before this client's next
request) so that its LRU order still sees them. `entries=0` turns the cache off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvcake.store.config import CACHE_ENTRIES
from kvcake.store.errors import InvalidRequest, StoreError
from kvcake.store.layout import HEADER_BYTES, CorruptObject, is_revoked, verify
from kvcake.store.master_api import Master
from kvcake.store.replica_io import segment_of
from kvcake.transfer import SegmentDesc, TransferError, TransferOp, TransferRequest

log = logging.getLogger(__name__)


class Location(NamedTuple):
    """Where a remembered object lives: its first replica (as the master described it)."""

    size_bytes: int
    checksum: int
    version: int
    offset: int
    segment: SegmentDesc


# A batch of remembered reads: (index, key, location, header view, payload view, whole view or
# None: header + payload contiguous, read as one request).
RememberedRead = tuple[int, str, Location, memoryview, memoryview, memoryview | None]


class LocationCache:
    """The remembered locations of one client's reader; reads go through `transfer`, cached
    reads are told to `master`."""

    def __init__(self, master: Master, transfer: Callable[[list[TransferRequest]], None],
                 entries: int = CACHE_ENTRIES) -> None:
        if entries < 0:
            raise InvalidRequest(f"cache_entries: must be >= 0, got {entries}")
        self.master = master
        self._transfer = transfer
        self._max_entries = entries
        self.entries: dict[str, Location] = {}

    def get(self, key: str) -> Location | None:
        return self.entries.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def remember(self, key: str, size_bytes: int, checksum: int,
                 replicas: list[dict[str, Any]]) -> None:
        """Where object `key` lives (after this client wrote or read it): its first revocable
        replica; nothing if none is."""
        if self._max_entries == 0:
            return
        first = next((r for r in replicas if r.get("revocable")), None)
        if first is None:
            return
        cache = self.entries
        if key not in cache and len(cache) >= self._max_entries:
            try:
                del cache[next(iter(cache))]  # the oldest entry
            except (KeyError, StopIteration, RuntimeError):  # another thread got there first
                pass
        cache[key] = Location(size_bytes, checksum, int(first["version"]), int(first["offset"]),
                              segment_of(first["segment"]))

    def forget(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.entries.pop(key, None)

    def remember_meta(self, key: str, meta: dict[str, Any],
                      header: bytes | bytearray | memoryview) -> None:
        """Remember `meta`'s first replica, whose `header` a read just brought back intact,
        unless that header says the replica is revoked already (it would only fail later)."""
        if self._max_entries and meta.get("checksum") is not None and meta.get("replicas") \
                and not is_revoked(header):
            self.remember(key, int(meta["size_bytes"]), int(meta["checksum"]), meta["replicas"])

    def remember_good(self, key: str, meta: dict[str, Any], replica: dict[str, Any],
                      header: bytes | bytearray | memoryview) -> None:
        """Remember `meta`'s location with the replica that just read intact (`header`) first."""
        if self._max_entries:
            replicas = [replica] + [r for r in meta["replicas"] if r is not replica]
            self.remember_meta(key, {**meta, "replicas": replicas}, header)

    def read(self, key: str, dest: memoryview, whole: memoryview | None) -> int | None:
        """Read `key` from its remembered location, checked; its size, or None (not
        remembered, or the check failed: the entry is dropped and the caller asks the master)."""
        where = self.entries.get(key)
        if where is None:
            return None
        size = where.size_bytes
        if len(dest) < size:
            return None  # the master path raises the error that says so
        if whole is not None:
            header = whole[:HEADER_BYTES]
            requests = [TransferRequest(TransferOp.READ, whole, where.segment, where.offset)]
        else:
            header = memoryview(bytearray(HEADER_BYTES))
            requests = [TransferRequest(TransferOp.READ, header, where.segment, where.offset)]
            if size:
                requests.append(TransferRequest(TransferOp.READ, dest, where.segment,
                                                where.offset + HEADER_BYTES, size))
        try:
            self._transfer(requests)
            verify(header, dest[:size], where.version, where.checksum, live=True)
        except (TransferError, ValueError, CorruptObject):
            # revoked (removed, evicted), reused or unreachable (not a corruption to report: the
            # master path checks the replicas it names, and reports those)
            self.entries.pop(key, None)
            return None
        self._touch(key)
        return size

    def read_many(self, items: list[RememberedRead]) -> dict[int, int]:
        """Read remembered objects in one transfer batch, each checked like `read`. Returns
        {index: size} of those served; an entry that fails is dropped (its key goes to the
        master)."""
        if not items:
            return {}
        requests = []
        for _, _, where, header, payload, whole in items:
            if whole is not None:
                requests.append(TransferRequest(TransferOp.READ, whole, where.segment,
                                                where.offset))
                continue
            requests.append(TransferRequest(TransferOp.READ, header, where.segment, where.offset))
            if where.size_bytes:
                requests.append(TransferRequest(TransferOp.READ, payload, where.segment,
                                                where.offset + HEADER_BYTES, where.size_bytes))
        try:
            self._transfer(requests)
        except (TransferError, ValueError):
            self.forget([key for _, key, _, _, _, _ in items])
            return {}
        served: dict[int, int] = {}
        for i, key, where, header, payload, _ in items:
            try:
                verify(header, payload, where.version, where.checksum, live=True)
            except CorruptObject:  # revoked, reused or corrupted: the master path decides
                self.entries.pop(key, None)
                continue
            served[i] = where.size_bytes
        self._touch(*dict.fromkeys(key for i, key, *_ in items if i in served))
        return served

    def _touch(self, *keys: str) -> None:
        """Tell the master of cached reads (a remote one merges them into one one-way message
        that goes before this client's next request, so every eviction it decides sees them)."""
        if not keys:
            return
        try:
            self.master.touch(list(keys))
        except StoreError as exc:  # only the LRU order misses these reads
            log.warning("telling the master of %d cached reads failed: %s", len(keys), exc)
