"""`ObjectWriter`: the client's put path, two-phase through the master.

    put_start (the master allocates replicas; this thread computes the payload checksums
    meanwhile) -> write header + payload into every replica -> put_commit with the checksums
    (acknowledged before `put_batch` returns); on any failure the batch's allocations are revoked.

Keys name content: a key already stored or being written is not written again (False).

A single put to a master that hosts a node (hosted.py) of up to its inline limit is one request
carrying the bytes and their checksum: the master's process verifies, allocates, writes and
commits them (PENDING -> COMPLETE) and answers once the object is readable.

Otherwise a single put of up to `SLOT_MAX_BYTES` goes through a slot instead: a keyless allocation the
master reserved beforehand (index.py), held here per object size. By default the put writes
header + payload into the slot (the node checks the bytes' digest before it answers), then one
master request names the key, commits it with its checksum (acknowledged before `put` returns)
and reserves the next slot of that size: two round trips instead of three, nothing weakened.
With `forward_puts` (opt-in) and a slot whose node has a forward port (a separate node, over
TCP: forward.py), it is one round trip: the bytes go to that node with the commit, the node checks them, writes the header and
sends the commit to the master itself, and its reply carries the master's acknowledgement.

`async_seal=True` (opt-in) takes the master off the critical path: the request that names the
slot with the key and checksum (PENDING, not readable) and reserves the next slot is sent first,
the bytes are written while the master handles it, its reply is read (ObjectExists: False, as
ever), and a one-way seal commits the object. A reader still never sees a half-written object (the
seal follows the node's verified write; a get of a named key waits for its seal, `seal_wait_s`,
then says ObjectNotFound) and this client's later requests see the object (its master connection
is in order); but `put` returns once the seal is sent, not acknowledged: should the master never
get it, the object is not stored, as if evicted at once. Measured side by side in
benchmarks/store_vs_peers.py (docs/benchmarks.md), it is not the default.

Either way a writer that dies leaves nothing readable (an unnamed slot, or a named object never
sealed, reclaimed after `put_timeout_s`). A slot is used only in the first half of
`put_timeout_s` (by this client's clock), so it is never written after the master could have
reclaimed it; an unused one is released at `close()`. The first put of a size reserves its slot
in a round trip of its own (put_start's place). Slots are not used with a master found through
etcd (a new leader does not know an old one's slots).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvcake.clock import Clock, SystemClock
from kvcake.store.errors import (
    InvalidRequest,
    ObjectExists,
    ObjectNotFound,
    StoreError,
    TransferFailed,
)
from kvcake.store.forward import ForwardLinks
from kvcake.store.layout import HEADER_BYTES, pack_header, payload_checksum
from kvcake.store.master_api import Master, unwrap
from kvcake.store.reader import Transfer
from kvcake.store.remote import RemoteMaster
from kvcake.store.replica_io import CHECKED, JOIN_BYTES, segment_of, write_requests
from kvcake.transfer import TransferError, TransferOp, TransferRequest, buffer_view

log = logging.getLogger(__name__)

# (key, payload, payload checksum, the replica descriptors put_start allocated for it)
Allocated = tuple[str, memoryview, int, list[dict[str, Any]]]
# Called after a commit: (key, size_bytes, checksum, replica descriptors) (the reader's cache).
OnWritten = Callable[[str, int, int, list[dict[str, Any]]], None]

SLOT_MAX_BYTES = 4 << 20  # single puts up to this size go through a reserved slot
_MAX_SHAPES = 8  # (size, replicas, local node) combinations a writer holds a slot for
_SLOTS_PER_SHAPE = 2  # slots held per combination (more come only from concurrent puts)
Shape = tuple[int, int | None, str | None]  # (size, num_replicas, local_node): what a slot fits


@dataclass(frozen=True)
class WriterOptions:
    """How an `ObjectWriter` writes. `direct`: its transfer may take the direct path, which moves
    a single-replica put as one pipelined header + payload write; `slots`: single puts go through
    reserved slots (module docstring); `async_seal`: a slot put is sealed one-way."""

    direct: bool = False
    slots: bool = True
    async_seal: bool = False


class SlotPut(NamedTuple):
    """One single put through a slot: the object, the slot it goes into, and what the commit
    request reserves next. (A named tuple: built once per put, at half a frozen dataclass's
    cost.)"""

    key: str
    view: memoryview
    checksum: int
    slot: dict[str, Any]
    num_replicas: int | None
    local_node: str | None

    @property
    def shape(self) -> Shape:
        return (len(self.view), self.num_replicas, self.local_node)

    @property
    def reserve(self) -> list[Any]:
        return [len(self.view), 1, self.num_replicas, self.local_node]

    @property
    def commit(self) -> list[Any]:
        return [self.key, self.slot["slot"], len(self.view), self.checksum]


class ObjectWriter:
    """Writes objects for one client through `transfer`, as `options` say."""

    def __init__(self, master: Master, transfer: Transfer,
                 options: WriterOptions | None = None, *, clock: Clock | None = None,
                 on_written: OnWritten | None = None,
                 forward: ForwardLinks | None = None) -> None:
        """`forward`: connections to nodes' forward ports, for acknowledged slot puts whose
        slot names one (forward.py); None: never forwarded."""
        options = options or WriterOptions()
        self._forward = forward
        self.master = master
        self._transfer = transfer
        self._direct = options.direct
        self._clock = clock or SystemClock()
        self._on_written = on_written
        self._use_slots = options.slots and not getattr(master, "follows_leader", False) \
            and hasattr(master, "put_slots")
        self._remote = isinstance(master, RemoteMaster)  # asked on every put: decided once
        # (size, num_replicas, local_node) -> [(slot descriptor, this clock when received)]
        self._slots: dict[Shape, list[tuple[dict[str, Any], float]]] = {}
        self._slot_lock = threading.Lock()
        self._async_seal = options.async_seal

    def put(self, key: str, value: Any, num_replicas: int | None,
            local_node: str | None) -> bool:
        """One object; through a slot when it is small enough (see the module docstring)."""
        view = buffer_view(value, field=f"value of {key!r}")
        size = len(view)
        if self._remote and isinstance(key, str) and key \
                and size <= self.master.inline_max_bytes() > 0:  # type: ignore[attr-defined]
            return self._put_inline(key, view, num_replicas, local_node)
        if not self._use_slots or size > SLOT_MAX_BYTES or not isinstance(key, str) or not key:
            return self.put_batch([key], [view], num_replicas, local_node)[0]
        shape = (size, num_replicas, local_node)
        reserve = [size, 1, num_replicas, local_node]
        slot = self._take(shape)
        if slot is None:  # the first put of this size: reserve while the checksum is computed
            result, checksum = self._put_slots([], reserve, lambda: payload_checksum(view))
            self._keep(shape, result["slots"])
            slot = self._take(shape)
            if slot is None:  # no room even for one: the ordinary put says why (NoSpace)
                return self.put_batch([key], [view], num_replicas, local_node)[0]
        else:
            checksum = payload_checksum(view)
        put = SlotPut(key, view, checksum, slot, num_replicas, local_node)
        if not self._async_seal:
            address = self._forward.route(slot) if self._forward is not None else None
            if address is not None:
                return self._put_forwarded(put, address)
        requests, digests = self._object_requests(view, checksum, slot["replicas"])
        if not self._async_seal:
            return self._put_acknowledged(put, requests, digests)

        def write() -> BaseException | None:  # the error, so that the master's reply is read
            try:
                self._transfer(requests, digests)
            except (TransferError, ValueError) as exc:
                return exc
            return None

        # Name the slot (sent first: the master handles it while the bytes go to the node),
        # write, then seal it one-way; a get of the key meanwhile waits for the seal.
        if isinstance(self.master, RemoteMaster):
            result, failed = self.master.put_slots_overlapped([put.commit], reserve, write,
                                                              seal_later=True)
        else:
            result = self.master.put_slots([put.commit], reserve, seal_later=True)
            failed = write()
        refused = self._refused(result, put)
        if refused is not None:
            return refused
        if failed is not None:  # named but not written: nobody may read it
            self.revoke(key)
            raise TransferFailed(f"put of {key!r} failed: {failed}") from failed
        self.master.put_seal([key])
        if self._on_written is not None:
            self._on_written(key, size, checksum, slot["replicas"])
        return True

    def _put_inline(self, key: str, view: memoryview, num_replicas: int | None,
                    local_node: str | None) -> bool:
        """One request to a master hosting a node (hosted.py): it checks the bytes against the
        checksum, allocates, writes and commits in its process, then answers (acknowledged)."""
        assert isinstance(self.master, RemoteMaster)
        checksum = payload_checksum(view)
        try:
            descs = self.master.put_inline(key, view, checksum, num_replicas, local_node)
        except ObjectExists:
            return False
        if self._on_written is not None:
            self._on_written(key, len(view), checksum, descs)
        return True

    def _put_acknowledged(self, put: SlotPut, requests: list[TransferRequest],
                          digests: list[int | None]) -> bool:
        """Write into the slot, then one request commits it (acknowledged) and reserves the
        next: two round trips."""
        try:
            self._transfer(requests, digests)
        except (TransferError, ValueError) as exc:
            self._release([put.slot["slot"]])
            raise TransferFailed(f"put of {put.key!r} failed: {exc}") from exc
        result = self.master.put_slots([put.commit], put.reserve)
        return self._settled(result, put)

    def _put_forwarded(self, put: SlotPut, address: str) -> bool:
        """The slot's node stores and checks the bytes, then commits them (and reserves the
        next slot) at the master: one round trip (forward.py). On any error the slot is
        released (a no-op if the master had committed it)."""
        assert self._forward is not None
        try:
            result = self._forward.put(address, put.slot, put.key, put.view, put.checksum,
                                       put.reserve)
        except StoreError:
            self._release([put.slot["slot"]])
            raise
        return self._settled(result, put)

    def _settled(self, result: dict[str, Any], put: SlotPut) -> bool:
        """What a committed slot put returns, from the master's `put_slots` answer: the
        refusal's answer (`_refused`), else True once the reader remembers where it lies."""
        refused = self._refused(result, put)
        if refused is not None:
            return refused
        if self._on_written is not None:
            self._on_written(put.key, len(put.view), put.checksum, put.slot["replicas"])
        return True

    def _refused(self, result: dict[str, Any], put: SlotPut) -> bool | None:
        """Keep the slots a `put_slots` answer reserved; None if it named the key, else what the
        put returns: False when the key exists (the slot is kept for the next put), the ordinary
        put's answer when the slot is gone (its node left)."""
        self._keep(put.shape, result["slots"])
        try:
            unwrap(result["results"][0])
        except ObjectExists:
            self._keep(put.shape, [put.slot], put.slot["_at"])  # still reserved: reused next
            return False
        except ObjectNotFound:
            return self.put_batch([put.key], [put.view], put.num_replicas, put.local_node)[0]
        return None

    def close(self) -> None:
        """Release the slots held (one-way; a remote master gets it before the connection
        closes). Idempotent."""
        with self._slot_lock:
            held = [s["slot"] for kept in self._slots.values() for s, _ in kept]
            self._slots.clear()
        if held:
            self._release(held)

    def _put_slots(self, commits: list[Any], reserve: list[Any],
                   work: Callable[[], int]) -> tuple[dict[str, Any], int]:
        if isinstance(self.master, RemoteMaster):
            return self.master.put_slots_overlapped(commits, reserve, work)
        value = work()
        return self.master.put_slots(commits, reserve), value

    def _take(self, shape: Shape) -> dict[str, Any] | None:
        """A slot of this shape still in the first half of its time, or None."""
        now_s = self._clock.now_s()
        stale: list[int] = []
        found = None
        with self._slot_lock:
            kept = self._slots.get(shape, [])
            while kept:
                slot, at_s = kept.pop()
                if now_s - at_s < float(slot.get("ttl_s", 0.0)) / 2:
                    found = {**slot, "_at": at_s}
                    break
                stale.append(slot["slot"])
        if stale:
            self._release(stale)
        return found

    def _keep(self, shape: Shape, slots: list[dict[str, Any]],
              at_s: float | None = None) -> None:
        if not slots:
            return
        at_s = self._clock.now_s() if at_s is None else at_s
        dropped: list[int] = []
        with self._slot_lock:
            if shape not in self._slots and len(self._slots) >= _MAX_SHAPES:
                oldest = next(iter(self._slots))
                dropped = [s["slot"] for s, _ in self._slots.pop(oldest)]
            kept = self._slots.setdefault(shape, [])
            kept.extend((s, at_s) for s in slots)
            while len(kept) > _SLOTS_PER_SHAPE:
                dropped.append(kept.pop(0)[0]["slot"])
        if dropped:
            self._release(dropped)

    def _release(self, slots: list[int]) -> None:
        try:
            self.master.release_slots(slots)
        except StoreError as exc:  # they time out on the master anyway
            log.warning("releasing %d slots failed: %s", len(slots), exc)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], num_replicas: int | None,
                  local_node: str | None) -> list[bool]:
        """Put every (key, value) with the given placement (None: the master's default); one
        master round trip per phase and one transfer batch."""
        if len(keys) != len(values):
            raise InvalidRequest(f"put_batch: {len(keys)} keys but {len(values)} values")
        views = [buffer_view(v, field=f"value of {k!r}") for k, v in zip(keys, values, strict=True)]
        items = [[k, len(v)] for k, v in zip(keys, views, strict=True)]
        starts, checksums = self._put_start(items, views, num_replicas, local_node)
        written: list[bool] = []
        allocated: list[Allocated] = []
        failure: StoreError | None = None
        for key, view, checksum, item in zip(keys, views, checksums, starts, strict=True):
            try:
                allocated.append((key, view, checksum, unwrap(item)))
                written.append(True)
            except ObjectExists:
                written.append(False)
            except StoreError as exc:  # e.g. NoSpace: undo the batch's other allocations below
                failure = failure or exc
        todo = [key for key, _, _, _ in allocated]
        if failure is not None:
            for key in todo:
                self.revoke(key)
            raise failure
        requests, digests = self._put_requests(allocated)
        if requests:
            try:
                self._transfer(requests, digests)
            except (TransferError, ValueError) as exc:
                for key in todo:
                    self.revoke(key)
                raise TransferFailed(f"put of {len(todo)} objects failed: {exc}") from exc
        for result in self.master.put_commit_batch([[k, c] for k, _, c, _ in allocated]):
            unwrap(result)
        if self._on_written is not None:
            for key, view, checksum, descs in allocated:
                self._on_written(key, len(view), checksum, descs)
        return written

    def revoke(self, key: str) -> None:
        """Undo a put in progress; a failure is only logged (the master reclaims it later)."""
        try:
            self.master.put_revoke(key)
        except StoreError as exc:
            log.warning("revoke of %r failed: %s", key, exc)

    def _put_start(self, items: list[list[Any]], views: list[memoryview],
                   num_replicas: int | None, local_node: str | None
                   ) -> tuple[list[Any], list[int]]:
        """Allocate (put_start without checksums) while this thread computes the payload
        checksums, which go with the commit."""
        def prepare() -> list[int]:
            return [payload_checksum(v) for v in views]

        if isinstance(self.master, RemoteMaster):
            return self.master.put_start_batch_overlapped(items, num_replicas, local_node, prepare)
        checksums = prepare()
        return self.master.put_start_batch(items, num_replicas, local_node), checksums

    def _put_requests(self, allocated: list[Allocated]
                      ) -> tuple[list[TransferRequest], list[int | None]]:
        """The writes of a put, and the xxh3 digest of each one's bytes where it is known."""
        if len(allocated) == 1:
            _, view, checksum, descs = allocated[0]
            return self._object_requests(view, checksum, descs)
        return [r for _, view, checksum, descs in allocated
                for r in write_requests(view, checksum, descs)], []

    def _object_requests(self, view: memoryview, checksum: int, descs: list[dict[str, Any]]
                         ) -> tuple[list[TransferRequest], list[int | None]]:
        """`_put_requests` of one object."""
        if self._direct and len(descs) == 1 and len(view) > JOIN_BYTES:
            # The direct path pipelines header and payload on one connection (one round trip,
            # no copy), and the payload's transport digest is its store checksum. Up to
            # JOIN_BYTES one joined request is cheaper (one send and one reply instead of two:
            # 64 KiB puts took ~45 us less; the copy and its digest cost a few us).
            (desc,) = descs
            segment = segment_of(desc["segment"])
            header = pack_header(checksum, desc["version"], len(view))
            requests = [TransferRequest(TransferOp.WRITE, header, segment, desc["offset"],
                                        checksum_tcp=CHECKED)]
            if len(view):
                requests.append(TransferRequest(TransferOp.WRITE, view, segment,
                                                desc["offset"] + HEADER_BYTES, checksum_tcp=CHECKED))
            return requests, [None, checksum]
        return write_requests(view, checksum, descs), []
