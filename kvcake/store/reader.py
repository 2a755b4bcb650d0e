"""`ObjectReader`: the client's get path, from the master's descriptors to checked bytes.

Every read is checked: the replica's header must carry the version the master handed out (so a
range reused by another object is never served) and the payload's checksum (xxh3-64) must match
the object's. A replica that fails the check, or whose node is gone, is skipped for the next;
after every replica failed the reader asks the master again, which may say the object is gone
(ObjectNotFound, a KeyError). On any error the contents of a caller's destination are undefined.

Each descriptor the master hands out comes with a read lease (the object is neither evicted nor
its range reused while it is held); the reader releases it, in a one-way message, as soon as the
read is over. A remote master gets that message with the client's next request (the same send:
no system call or master wake-up of its own), so a client that goes quiet holds its last leases
until then or `lease_s`; holding a lease longer is always safe, it only delays eviction.

Location cache: the reader remembers where each object it wrote or read lives (size, checksum,
replica version and offset; up to `cache_entries` keys), and `get`, `get_into` and the batch gets
read a remembered key's replica straight away, without asking the master: one round trip instead
of two.
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
request) so that its LRU order still sees them. `cache_entries=0` turns the cache off.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from kvcake.store.errors import (
    InvalidRequest,
    ObjectNotFound,
    ObjectUnavailable,
    StoreError,
    TransferFailed,
)
from kvcake.store.layout import HEADER_BYTES, CorruptObject, is_revoked, verify
from kvcake.store.master_api import Master, unwrap
from kvcake.store.replica_io import check_room, read_requests, segment_of, valid
from kvcake.transfer import (
    SegmentDesc,
    TransferError,
    TransferOp,
    TransferRequest,
    buffer_view,
)

log = logging.getLogger(__name__)

# A batch get's scratch (header + payload of every object) is kept per thread up to this size;
# a larger batch reads into a buffer of its own.
_BATCH_SCRATCH_BYTES = 256 << 20
_READ_ROUNDS = 3  # how many times the reader asks the master again after every replica failed
CACHE_ENTRIES = 1 << 15  # keys whose location a reader remembers by default (~200 bytes each)

Leased = list[tuple[str, dict[str, Any]]]  # (key, descriptor with its "lease_id") to release


class Transfer(Protocol):
    """How the client moves a batch of requests (`StoreClient._transfer`): TransferError (or
    ValueError for a bad request) if it cannot. `xxh3_digests`, where known, are the xxh3-64
    digests of the requests' bytes (a write's payload digest is its object checksum)."""

    def __call__(self, requests: list[TransferRequest],
                 xxh3_digests: list[int | None] | None = None) -> None: ...


class ObjectReader:
    """Reads objects for one client through `transfer`. `recheck` is the engine's checked path
    (a transport checksum on every slice), given when `transfer` may take the direct path, which
    reads without one: a replica that fails the end-to-end check is read once more through
    `recheck` before it is called corrupt."""

    def __init__(self, master: Master, transfer: Transfer,
                 recheck: Callable[[list[TransferRequest]], None] | None,
                 cache_entries: int = CACHE_ENTRIES) -> None:
        if cache_entries < 0:
            raise InvalidRequest(f"cache_entries: must be >= 0, got {cache_entries}")
        self.master = master
        self._transfer = transfer
        self._recheck = recheck
        self._local = threading.local()
        self._cache_entries = cache_entries
        self._cache: dict[str, _Location] = {}

    # ---- location cache ------------------------------------------------------------------------
    def remember(self, key: str, size_bytes: int, checksum: int,
                 replicas: list[dict[str, Any]]) -> None:
        """Where object `key` lives (after this client wrote or read it): its first revocable
        replica; nothing if none is."""
        if self._cache_entries == 0:
            return
        first = next((r for r in replicas if r.get("revocable")), None)
        if first is None:
            return
        cache = self._cache
        if key not in cache and len(cache) >= self._cache_entries:
            try:
                del cache[next(iter(cache))]  # the oldest entry
            except (KeyError, StopIteration, RuntimeError):  # another thread got there first
                pass
        cache[key] = _Location(size_bytes, checksum, int(first["version"]), int(first["offset"]),
                               segment_of(first["segment"]))

    def forget(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._cache.pop(key, None)

    def _remember_meta(self, key: str, meta: dict[str, Any],
                       header: bytes | bytearray | memoryview) -> None:
        """Remember `meta`'s first replica, whose `header` a read just brought back intact,
        unless that header says the replica is revoked already (it would only fail later)."""
        if self._cache_entries and meta.get("checksum") is not None and meta.get("replicas") \
                and not is_revoked(header):
            self.remember(key, int(meta["size_bytes"]), int(meta["checksum"]), meta["replicas"])

    def _cached_read(self, key: str, dest: memoryview, whole: memoryview | None) -> int | None:
        """Read `key` from its remembered location, checked; its size, or None (not
        remembered, or the check failed: the entry is dropped and the caller asks the master)."""
        where = self._cache.get(key)
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
            self._cache.pop(key, None)
            return None
        self._touch(key)
        return size

    def _read_remembered(self, items: list[tuple[int, str, _Location, memoryview, memoryview,
                                                  memoryview | None]]) -> dict[int, int]:
        """Read remembered objects in one transfer batch, each checked like `_cached_read`.
        `items`: (index, key, location, header view, payload view, whole view or None: header +
        payload contiguous, read as one request). Returns {index: size} of those served; an
        entry that fails is dropped (its key goes to the master)."""
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
                self._cache.pop(key, None)
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

    # ---- gets --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound (a KeyError) if the key is not stored."""
        # One contiguous read (header + payload: one request, fewer slices) into a reused buffer
        # whose pages are already mapped; the only copy is the final bytes().
        cached = self._cache.get(key)
        if cached is not None:
            size = cached.size_bytes
            scratch = self._buffer("scratch", HEADER_BYTES + size)
            if self._cached_read(key, scratch[HEADER_BYTES:], scratch) is not None:
                return bytes(scratch[HEADER_BYTES:])
        meta = self.master.get(key)
        size = int(meta["size_bytes"])
        scratch = self._buffer("scratch", HEADER_BYTES + size)
        self.read(key, meta, scratch[HEADER_BYTES:HEADER_BYTES + size], whole=scratch)
        return bytes(scratch[HEADER_BYTES:HEADER_BYTES + size])

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the object into the start of `buffer` (writable, large enough); returns its
        size in bytes."""
        dest = buffer_view(buffer, writable=True, field="buffer")
        if key in self._cache:
            size = self._cached_read(key, dest, None)
            if size is not None:
                return size
        meta = self.master.get(key)
        return self.read(key, meta, dest)

    def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        """Read each key into its buffer; returns each size, None for a key that is not stored.
        Keys whose location this reader remembers are read first, in one transfer batch and no
        master request; the others (and any remembered read that fails its check) with one
        master round trip and one transfer batch; a replica that fails its check is retried
        alone. Raises TransferFailed if a stored object cannot be read intact at all."""
        if len(keys) != len(buffers):
            raise InvalidRequest(f"get_batch_into: {len(keys)} keys but {len(buffers)} buffers")
        dests = [buffer_view(b, writable=True, field=f"buffer of {k!r}")
                 for k, b in zip(keys, buffers, strict=True)]
        sizes: list[int | None] = [None] * len(keys)
        remembered: list[tuple[int, str, _Location, memoryview, memoryview, memoryview | None]] = []
        for i, key in enumerate(keys):
            where = self._cache.get(key)
            if where is not None and len(dests[i]) >= where.size_bytes:
                remembered.append((i, key, where, memoryview(bytearray(HEADER_BYTES)),
                                   dests[i][:where.size_bytes], None))
        served = self._read_remembered(remembered)  # index -> size
        for i, size in served.items():
            sizes[i] = size
        rest = [i for i in range(len(keys)) if i not in served]
        if not rest:
            return sizes
        metas = self._metas([keys[i] for i in rest])
        jobs = [(keys[i], m, dests[i]) for i, m in zip(rest, metas, strict=True) if m is not None]
        try:
            self._read_batch(jobs)
        finally:
            self.release([(key, meta) for key, meta, _ in jobs])
        for i, meta in zip(rest, metas, strict=True):
            if meta is not None:
                sizes[i] = int(meta["size_bytes"])
        return sizes

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's bytes as a new `bytes`, None for a key that is not stored. Keys whose
        location this reader remembers are read first (one transfer batch, no master request);
        the others with one master round trip and one transfer batch. Every object is read whole
        (header + payload, one request) into this thread's reused scratch, whose pages are
        already mapped, then checked and copied out once; a replica that fails its check is read
        again alone."""
        values: list[bytes | None] = [None] * len(keys)
        remembered, total = [], 0
        for i, key in enumerate(keys):
            where = self._cache.get(key)
            if where is not None:
                remembered.append((i, key, where, total))
                total += HEADER_BYTES + where.size_bytes
        served: dict[int, int] = {}
        if remembered:
            scratch = self._buffer("batch", total) if total <= _BATCH_SCRATCH_BYTES \
                else memoryview(bytearray(total))
            wholes = [scratch[at:at + HEADER_BYTES + where.size_bytes]
                      for _, _, where, at in remembered]
            served = self._read_remembered([
                (i, key, where, whole[:HEADER_BYTES], whole[HEADER_BYTES:], whole)
                for (i, key, where, _), whole in zip(remembered, wholes, strict=True)])
            for (i, _, _, _), whole in zip(remembered, wholes, strict=True):
                if i in served:
                    values[i] = bytes(whole[HEADER_BYTES:])
        rest = [i for i in range(len(keys)) if i not in served]
        if rest:
            for i, value in zip(rest, self._get_batch_leased([keys[i] for i in rest]),
                                strict=True):
                values[i] = value
        return values

    def _get_batch_leased(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get_batch` through the master: descriptors and read leases in one round trip."""
        metas = self._metas(keys)
        jobs = [(k, m) for k, m in zip(keys, metas, strict=True) if m is not None]
        offsets, total = [], 0
        for _, meta in jobs:
            offsets.append(total)
            total += HEADER_BYTES + int(meta["size_bytes"])
        scratch = self._buffer("batch", total) if total <= _BATCH_SCRATCH_BYTES \
            else memoryview(bytearray(total))
        values: list[bytes] = []
        try:
            requests = []
            for (_, meta), offset in zip(jobs, offsets, strict=True):
                replica = meta["replicas"][0]
                whole = scratch[offset:offset + HEADER_BYTES + int(meta["size_bytes"])]
                requests.append(TransferRequest(TransferOp.READ, whole,
                                                segment_of(replica["segment"]), replica["offset"]))
            batch_ok = True
            try:
                if requests:
                    self._transfer(requests)
            except TransferError:
                batch_ok = False
            for (key, meta), offset in zip(jobs, offsets, strict=True):
                size = int(meta["size_bytes"])
                header = scratch[offset:offset + HEADER_BYTES]
                payload = scratch[offset + HEADER_BYTES:offset + HEADER_BYTES + size]
                if not batch_ok or not valid(meta["replicas"][0], meta, header, payload):
                    self.read(key, meta, payload)  # replica by replica, asking the master again
                else:
                    self._remember_meta(key, meta, header)
                values.append(bytes(payload))
        finally:
            self.release(jobs)
        done = iter(values)
        return [None if m is None else next(done) for m in metas]

    def _metas(self, keys: Sequence[str]) -> list[dict[str, Any] | None]:
        """The master's descriptors of `keys` (one round trip), None for a key not stored."""
        metas: list[dict[str, Any] | None] = []
        for item in self.master.get_batch(list(keys)):
            try:
                metas.append(unwrap(item))
            except ObjectNotFound:
                metas.append(None)
        return metas

    def read(self, key: str, meta: dict[str, Any], dest: memoryview,
             whole: memoryview | None = None) -> int:
        """Read a replica of descriptor `meta` into `dest`, checked; returns the object's size.
        With `whole` (header + payload bytes, `dest` being its payload part), the object is read
        in one request. Releases the read lease of `meta` and of every descriptor it asks for
        again, when done."""
        leased = [(key, meta)]
        try:
            return self._read_replicas(key, meta, dest, whole, leased)
        finally:
            self.release(leased)

    def release(self, leased: Leased) -> None:
        """Tell the master these reads are over (one message, no round trip), so the objects
        may be evicted again without waiting out `lease_s`."""
        leases = [[key, meta["lease_id"]] for key, meta in leased if "lease_id" in meta]
        if not leases:
            return
        try:
            self.master.release_leases(leases)
        except StoreError as exc:  # the leases then just run out
            log.warning("releasing %d read leases failed: %s", len(leases), exc)

    def _buffer(self, name: str, num_bytes: int) -> memoryview:
        """This thread's reused buffer `name`, at least `num_bytes` long (grown, never shrunk)."""
        buffer: bytearray | None = getattr(self._local, name, None)
        if buffer is None or len(buffer) < num_bytes:
            buffer = bytearray(num_bytes)
            setattr(self._local, name, buffer)
        return memoryview(buffer)[:num_bytes]

    def _read_batch(self, jobs: list[tuple[str, dict[str, Any], memoryview]]) -> None:
        for key, meta, dest in jobs:
            check_room(key, meta, dest)
        headers = [bytearray(HEADER_BYTES) for _ in jobs]
        requests = []
        for (_, meta, dest), header in zip(jobs, headers, strict=True):
            requests.extend(read_requests(meta["replicas"][0], meta, header, dest))
        batch_ok = True
        try:
            if requests:
                self._transfer(requests)
        except TransferError:
            batch_ok = False
        for (key, meta, dest), header in zip(jobs, headers, strict=True):
            if not batch_ok or not valid(meta["replicas"][0], meta, header, dest):
                self.read(key, meta, dest)  # replica by replica, asking the master again
            else:
                self._remember_meta(key, meta, header)

    def _remember_good(self, key: str, meta: dict[str, Any], replica: dict[str, Any],
                       header: bytes | bytearray | memoryview) -> None:
        """Remember `meta`'s location with the replica that just read intact (`header`) first."""
        if self._cache_entries:
            replicas = [replica] + [r for r in meta["replicas"] if r is not replica]
            self._remember_meta(key, {**meta, "replicas": replicas}, header)

    def _read_replicas(self, key: str, meta: dict[str, Any], dest: memoryview,
                       whole: memoryview | None, leased: Leased) -> int:
        check_room(key, meta, dest)
        header: bytearray | memoryview = bytearray(HEADER_BYTES)
        errors: list[str] = []
        num_corrupt = 0
        for _ in range(_READ_ROUNDS):
            for replica in meta["replicas"]:
                if whole is not None:
                    header = whole[:HEADER_BYTES]
                    requests = [TransferRequest(TransferOp.READ, whole,
                                                segment_of(replica["segment"]), replica["offset"])]
                else:
                    requests = read_requests(replica, meta, header, dest)
                try:
                    self._transfer(requests)
                    if valid(replica, meta, header, dest):
                        self._remember_good(key, meta, replica, header)
                        return int(meta["size_bytes"])
                    if self._recheck is not None:
                        # The direct path reads without a transport checksum (the check above
                        # is end to end): once more through the engine's checked path before
                        # this replica is called corrupt.
                        self._recheck(requests)
                        if valid(replica, meta, header, dest):
                            self._remember_good(key, meta, replica, header)
                            return int(meta["size_bytes"])
                except (TransferError, ValueError) as exc:
                    errors.append(f"{replica['node_id']}: {exc}")
                    continue
                num_corrupt += 1
                errors.append(f"{replica['node_id']}: bad bytes")
            meta = self.master.get(key)  # ObjectNotFound if the object went with its nodes
            leased.append((key, meta))
            check_room(key, meta, dest)
        if num_corrupt == 0:
            raise ObjectUnavailable(f"no replica of {key!r} is reachable (nodes down?): "
                                    f"{errors[-2:]}")
        raise TransferFailed(f"no replica of {key!r} could be read intact: {errors[-3:]}")



class _Location(NamedTuple):
    """Where a remembered object lives: its first replica (as the master described it)."""

    size_bytes: int
    checksum: int
    version: int
    offset: int
    segment: SegmentDesc
