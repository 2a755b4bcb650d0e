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

Location cache (locations.py): `get`, `get_into` and the batch gets read a key this client wrote
or read from its remembered replica first, without asking the master (one round trip instead of
two), checked as strictly; any failure sends the get to the master as usual.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvcake.store.errors import (
    InvalidRequest,
    ObjectNotFound,
    ObjectUnavailable,
    StoreError,
    TransferFailed,
)
from kvcake.store.layout import HEADER_BYTES
from kvcake.store.locations import CACHE_ENTRIES, Location, LocationCache, RememberedRead
from kvcake.store.master_api import Master, unwrap
from kvcake.store.replica_io import check_room, read_requests, segment_of, valid
from kvcake.transfer import TransferError, TransferOp, TransferRequest, buffer_view

__all__ = ["CACHE_ENTRIES", "Leased", "ObjectReader", "Transfer"]

log = logging.getLogger(__name__)

# A batch get's scratch (header + payload of every object) is kept per thread up to this size;
# a larger batch reads into a buffer of its own.
_BATCH_SCRATCH_BYTES = 256 << 20
_READ_ROUNDS = 3  # how many times the reader asks the master again after every replica failed

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
        self.master = master
        self._transfer = transfer
        self._recheck = recheck
        self._local = threading.local()
        self._locations = LocationCache(master, transfer, cache_entries)

    # ---- location cache (locations.py) -------------------------------------------------------
    def remember(self, key: str, size_bytes: int, checksum: int,
                 replicas: list[dict[str, Any]]) -> None:
        """Where object `key` lives (after this client wrote or read it): its first revocable
        replica; nothing if none is."""
        self._locations.remember(key, size_bytes, checksum, replicas)

    def forget(self, keys: Sequence[str]) -> None:
        self._locations.forget(keys)

    # ---- gets --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound (a KeyError) if the key is not stored."""
        # One contiguous read (header + payload: one request, fewer slices) into a reused buffer
        # whose pages are already mapped; the only copy is the final bytes().
        cached = self._locations.get(key)
        if cached is not None:
            size = cached.size_bytes
            scratch = self._buffer("scratch", HEADER_BYTES + size)
            if self._locations.read(key, scratch[HEADER_BYTES:], scratch) is not None:
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
        if key in self._locations:
            size = self._locations.read(key, dest, None)
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
        remembered: list[RememberedRead] = []
        for i, key in enumerate(keys):
            where = self._locations.get(key)
            if where is not None and len(dests[i]) >= where.size_bytes:
                remembered.append((i, key, where, memoryview(bytearray(HEADER_BYTES)),
                                   dests[i][:where.size_bytes], None))
        served = self._locations.read_many(remembered)  # index -> size
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
        remembered: list[tuple[int, str, Location, int]] = []
        total = 0
        for i, key in enumerate(keys):
            where = self._locations.get(key)
            if where is not None:
                remembered.append((i, key, where, total))
                total += HEADER_BYTES + where.size_bytes
        served: dict[int, int] = {}
        if remembered:
            scratch = self._buffer("batch", total) if total <= _BATCH_SCRATCH_BYTES \
                else memoryview(bytearray(total))
            wholes = [scratch[at:at + HEADER_BYTES + where.size_bytes]
                      for _, _, where, at in remembered]
            served = self._locations.read_many([
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
                    self._locations.remember_meta(key, meta, header)
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
                self._locations.remember_meta(key, meta, header)

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
                        self._locations.remember_good(key, meta, replica, header)
                        return int(meta["size_bytes"])
                    if self._recheck is not None:
                        # The direct path reads without a transport checksum (the check above
                        # is end to end): once more through the engine's checked path before
                        # this replica is called corrupt.
                        self._recheck(requests)
                        if valid(replica, meta, header, dest):
                            self._locations.remember_good(key, meta, replica, header)
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
