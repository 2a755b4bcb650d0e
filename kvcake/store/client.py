"""`StoreClient`: put and get objects; metadata from the master, bytes through the transfer engine.

    with StoreClient("127.0.0.1:21000") as store:
        store.put("ns:00ab..", data)            # 1. master allocates replicas  2. client writes
        store.get("ns:00ab..") -> bytes         #    each one  3. commit;  get: descriptors from
        store.get_into("ns:00ab..", buffer)     #    the master, bytes read straight from a node

Every read is checked: the replica's header must carry the version the master handed out (so a
range reused by another object is never served) and the payload's checksum (xxh3-64) must match
the object's. A replica that fails the check, or whose node is gone, is skipped for the next;
after every replica failed the client asks the master again, which may say the object is gone
(KeyError).
On any error the contents of a caller's destination buffer are undefined.

Each descriptor the master hands out comes with a read lease (the object is neither evicted nor
its range reused while it is held); the client releases it, in a one-way message, as soon as the
read is over. A put sends put_start without the checksum and computes it while the master
allocates; the checksum goes with the commit, which is acknowledged before `put` returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from kvcake.store.direct import DirectPath
from kvcake.store.errors import (
    WIRE_ERRORS,
    InvalidRequest,
    ObjectExists,
    ObjectNotFound,
    ObjectUnavailable,
    StoreError,
    TransferFailed,
)
from kvcake.store.layout import HEADER_BYTES, pack_header, payload_checksum
from kvcake.store.remote import RemoteMaster
from kvcake.store.replica_io import (
    check_room,
    read_requests,
    valid,
    write_checksum,
    write_requests,
)
from kvcake.transfer import (
    SegmentDesc,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    TransportWrapper,
    buffer_view,
)

if TYPE_CHECKING:
    import torch

    from kvcake.store.config import EmbeddedConfig
    from kvcake.store.embedded import EmbeddedStore

log = logging.getLogger(__name__)

_READ_ROUNDS = 3  # how many times the client asks the master again after every replica failed


class Master(Protocol):
    """What the client needs of a master: `MasterService` in-process or `RemoteMaster`."""

    def put_start(self, key: str, size_bytes: int, checksum: int | None,
                  num_replicas: int | None = None,
                  local_node: str | None = None) -> list[dict[str, Any]]: ...
    def put_commit(self, key: str, checksum: int | None = None) -> None: ...
    def put_revoke(self, key: str) -> None: ...
    def get(self, key: str) -> dict[str, Any]: ...
    def exists(self, key: str) -> bool: ...
    def remove(self, key: str) -> None: ...
    def pin(self, key: str, pinned: bool) -> None: ...
    def add_replicas(self, key: str, num_replicas: int) -> dict[str, Any]: ...
    def replicas_done(self, key: str, versions: list[int], ok: bool) -> None: ...
    def drop_replicas(self, key: str, num_replicas: int) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def put_start_batch(self, items: list[Any], num_replicas: int | None = None,
                        local_node: str | None = None) -> list[Any]: ...
    def put_commit_batch(self, keys: list[Any]) -> list[Any]: ...
    def get_batch(self, keys: list[Any]) -> list[Any]: ...
    def release_leases(self, leases: list[Any]) -> None: ...
    def exists_batch(self, keys: list[Any]) -> list[Any]: ...
    def remove_batch(self, keys: list[Any]) -> list[Any]: ...


def _unwrap(item: dict[str, Any]) -> Any:
    """The result of one batch entry, or its error raised again."""
    if item.get("ok"):
        return item.get("result")
    error = item.get("error") or {}
    raise WIRE_ERRORS.get(str(error.get("type")), StoreError)(str(error.get("message", "")))


class StoreClient:
    """A client of one store. `master` is "HOST:PORT" or an in-process master service.

    The transfer engine starts on first use (or pass a started `engine` to share one). Set
    `transfer_config.use_shared_memory=False` to force TCP even to nodes on this host. A client
    with its own engine moves batches of up to `slice_bytes` on the calling thread (`DirectPath`);
    `wrap_transport` wraps every endpoint of both (tests inject faults with it).
    """

    def __init__(self, master: str | Master, *, engine: TransferEngine | None = None,
                 transfer_config: TransferConfig | None = None, num_replicas: int | None = None,
                 local_node: str | None = None,
                 wrap_transport: TransportWrapper | None = None) -> None:
        if isinstance(master, str):
            master = RemoteMaster(master)
        self.master: Master = master
        self._own_engine = engine is None
        self._engine = engine
        self._transfer_config = transfer_config or TransferConfig(serve=False)
        self._wrap = wrap_transport
        # A shared engine is used as it is (it may carry a test's transport wrapper).
        self._direct = DirectPath(self._transfer_config, wrap_transport) if engine is None \
            else None
        self._started = engine is not None
        self.num_replicas = num_replicas
        self.local_node = local_node
        self._embedded: EmbeddedStore | None = None
        self._local = threading.local()
        self._start_lock = threading.Lock()

    @classmethod
    def embedded(cls, config: EmbeddedConfig | int, **kwargs: Any) -> StoreClient:
        """A client with its own in-process store (`config`, or just its DRAM bytes for one
        node); close() stops it. kwargs go to `EmbeddedStore` (clock, wrap_transport)."""
        from kvcake.store.config import EmbeddedConfig
        from kvcake.store.embedded import EmbeddedStore

        if not isinstance(config, EmbeddedConfig):
            config = EmbeddedConfig(dram_bytes=config)
        store = EmbeddedStore(config, **kwargs)
        store.start()
        client = store.client()
        client._embedded = store
        return client

    @property
    def engine(self) -> TransferEngine:
        if not self._started:
            with self._start_lock:  # first use may come from several threads at once
                if self._engine is None:
                    self._engine = TransferEngine(self._transfer_config,
                                                  wrap_transport=self._wrap)
                if not self._started:
                    self._engine.start()
                    self._started = True
        assert self._engine is not None
        return self._engine

    @property
    def _use_shared_memory(self) -> bool:
        """The `use_shared_memory` of the engine this client moves bytes with."""
        engine = self._engine if not self._own_engine else None
        return (engine.config if engine is not None else self._transfer_config).use_shared_memory

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self._own_engine and self._engine is not None and self._started:
            self._engine.close()
            self._started = False
        close = getattr(self.master, "close", None)
        if close is not None and self._embedded is None:
            close()
        if self._embedded is not None:
            self._embedded.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- put -------------------------------------------------------------------------------------
    def put(self, key: str, data: Any) -> bool:
        """Store `data` (bytes-like, numpy array, CPU tensor) under `key`. Returns False, writing
        nothing, if the key is already stored or being written (keys name content)."""
        return self.put_batch([key], [data])[0]

    def put_batch(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        """Put every (key, value); one master round trip per phase and one transfer batch."""
        if len(keys) != len(values):
            raise InvalidRequest(f"put_batch: {len(keys)} keys but {len(values)} values")
        views = [buffer_view(v, field=f"value of {k!r}") for k, v in zip(keys, values, strict=True)]
        items = [[k, len(v)] for k, v in zip(keys, views, strict=True)]
        starts, checksums = self._put_start(items, views)
        written: list[bool] = []
        allocated: list[tuple[str, memoryview, int, list[dict[str, Any]]]] = []
        failure: StoreError | None = None
        for key, view, checksum, item in zip(keys, views, checksums, starts, strict=True):
            try:
                allocated.append((key, view, checksum, _unwrap(item)))
                written.append(True)
            except ObjectExists:
                written.append(False)
            except StoreError as exc:  # e.g. NoSpace: undo the batch's other allocations below
                failure = failure or exc
        todo = [key for key, _, _, _ in allocated]
        if failure is not None:
            for key in todo:
                self._revoke(key)
            raise failure
        requests, digests = self._put_requests(allocated)
        if requests:
            try:
                self._transfer(requests, digests)
            except (TransferError, ValueError) as exc:
                for key in todo:
                    self._revoke(key)
                raise TransferFailed(f"put of {len(todo)} objects failed: {exc}") from exc
        for result in self.master.put_commit_batch([[k, c] for k, _, c, _ in allocated]):
            _unwrap(result)
        return written

    def _put_start(self, items: list[list[Any]], views: list[memoryview]
                   ) -> tuple[list[Any], list[int]]:
        """Allocate (put_start without checksums) while this thread computes the payload
        checksums, which go with the commit."""
        def prepare() -> list[int]:
            return [payload_checksum(v) for v in views]

        if isinstance(self.master, RemoteMaster):
            return self.master.put_start_batch_overlapped(items, self.num_replicas,
                                                          self.local_node, prepare)
        checksums = prepare()
        return self.master.put_start_batch(items, self.num_replicas, self.local_node), checksums

    def _put_requests(self, allocated: list[tuple[str, memoryview, int, list[dict[str, Any]]]]
                      ) -> tuple[list[TransferRequest], list[int | None]]:
        """The writes of a put, and the xxh3 digest of each one's bytes where it is known."""
        if self._direct is not None and len(allocated) == 1 and len(allocated[0][3]) == 1:
            # The direct path pipelines header and payload on one connection (one round trip,
            # no copy), and the payload's transport digest is its store checksum.
            _, view, checksum, (desc,) = allocated[0]
            segment = SegmentDesc.from_dict(desc["segment"])
            header = pack_header(checksum, desc["version"], len(view))
            digest = write_checksum(segment, self._use_shared_memory)
            requests = [TransferRequest(TransferOp.WRITE, header, segment, desc["offset"],
                                        checksum=digest)]
            if len(view):
                requests.append(TransferRequest(TransferOp.WRITE, view, segment,
                                                desc["offset"] + HEADER_BYTES, checksum=digest))
            return requests, [None, checksum]
        return [r for _, view, checksum, descs in allocated
                for r in write_requests(view, checksum, descs, self._use_shared_memory)], []

    def _transfer(self, requests: list[TransferRequest],
                  xxh3_digests: list[int | None] | None = None) -> None:
        """Move a batch: on this thread when it is small (`DirectPath`), else (or if that fails)
        through the engine, which retries on other rails. TransferError if it cannot be moved."""
        direct = self._direct
        if direct is not None and direct.accepts(requests) \
                and direct.transfer(requests, xxh3_digests or ()):
            return
        self.engine.transfer(requests)

    def _revoke(self, key: str) -> None:
        try:
            self.master.put_revoke(key)
        except StoreError as exc:
            log.warning("revoke of %r failed: %s", key, exc)

    # ---- get -------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound (a KeyError) if the key is not stored."""
        meta = self.master.get(key)
        size = int(meta["size_bytes"])
        # One contiguous read (header + payload: one request, fewer slices) into a reused buffer
        # whose pages are already mapped; the only copy is the final bytes().
        scratch = self._buffer("scratch", HEADER_BYTES + size)
        self._read(key, meta, scratch[HEADER_BYTES:HEADER_BYTES + size], whole=scratch)
        return bytes(scratch[HEADER_BYTES:HEADER_BYTES + size])

    def _buffer(self, name: str, num_bytes: int) -> memoryview:
        """This thread's reused buffer `name`, at least `num_bytes` long (grown, never shrunk)."""
        buffer: bytearray | None = getattr(self._local, name, None)
        if buffer is None or len(buffer) < num_bytes:
            buffer = bytearray(num_bytes)
            setattr(self._local, name, buffer)
        return memoryview(buffer)[:num_bytes]

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the object into the start of `buffer` (writable, large enough); returns its
        size in bytes."""
        dest = buffer_view(buffer, writable=True, field="buffer")
        meta = self.master.get(key)
        return self._read(key, meta, dest)

    def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        """Read each key into its buffer; returns each size, None for a key that is not stored.
        One master round trip and one transfer batch; a replica that fails its check is retried
        alone. Raises TransferFailed if a stored object cannot be read intact at all."""
        if len(keys) != len(buffers):
            raise InvalidRequest(f"get_batch_into: {len(keys)} keys but {len(buffers)} buffers")
        dests = [buffer_view(b, writable=True, field=f"buffer of {k!r}")
                 for k, b in zip(keys, buffers, strict=True)]
        metas: list[dict[str, Any] | None] = []
        for item in self.master.get_batch(list(keys)):
            try:
                metas.append(_unwrap(item))
            except ObjectNotFound:
                metas.append(None)
        jobs = [(k, m, d) for k, m, d in zip(keys, metas, dests, strict=True) if m is not None]
        try:
            self._read_batch(jobs)
        finally:
            self._release([(key, meta) for key, meta, _ in jobs])
        sizes: list[int | None] = [None if m is None else int(m["size_bytes"]) for m in metas]
        return sizes

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
                self._read(key, meta, dest)  # replica by replica, asking the master again

    def _release(self, leased: list[tuple[str, dict[str, Any]]]) -> None:
        """Tell the master these reads are over (one message, no round trip), so the objects
        may be evicted again without waiting out `lease_s`."""
        leases = [[key, meta["lease_id"]] for key, meta in leased if "lease_id" in meta]
        if not leases:
            return
        try:
            self.master.release_leases(leases)
        except StoreError as exc:  # the leases then just run out
            log.warning("releasing %d read leases failed: %s", len(leases), exc)

    def _read(self, key: str, meta: dict[str, Any], dest: memoryview,
              whole: memoryview | None = None) -> int:
        """Read a replica into `dest`, checked. With `whole` (header + payload bytes, `dest`
        being its payload part), the object is read in one request. Releases the read lease of
        `meta` and of every descriptor it asks for again, when done."""
        leased = [(key, meta)]
        try:
            return self._read_replicas(key, meta, dest, whole, leased)
        finally:
            self._release(leased)

    def _read_replicas(self, key: str, meta: dict[str, Any], dest: memoryview,
                       whole: memoryview | None, leased: list[tuple[str, dict[str, Any]]]) -> int:
        check_room(key, meta, dest)
        header: bytearray | memoryview = bytearray(HEADER_BYTES)
        errors: list[str] = []
        num_corrupt = 0
        for _ in range(_READ_ROUNDS):
            for replica in meta["replicas"]:
                if whole is not None:
                    header = whole[:HEADER_BYTES]
                    requests = [TransferRequest(TransferOp.READ, whole, SegmentDesc.from_dict(
                        replica["segment"]), replica["offset"])]
                else:
                    requests = read_requests(replica, meta, header, dest)
                try:
                    self._transfer(requests)
                    if valid(replica, meta, header, dest):
                        return int(meta["size_bytes"])
                    if self._direct is not None:
                        # The direct path reads without a transport checksum (the check above
                        # is end to end): once more through the engine's checked path before
                        # this replica is called corrupt.
                        self.engine.transfer(requests)
                        if valid(replica, meta, header, dest):
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

    # ---- the rest ----------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.master.exists(key)

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return [bool(_unwrap(item)) for item in self.master.exists_batch(list(keys))]

    def remove(self, key: str) -> None:
        """Forget `key` (ObjectNotFound if absent). Readers holding a lease finish safely."""
        self.master.remove(key)

    def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        """True for each key removed, False for each that was not stored."""
        out = []
        for item in self.master.remove_batch(list(keys)):
            try:
                _unwrap(item)
                out.append(True)
            except ObjectNotFound:
                out.append(False)
        return out

    def pin(self, key: str, pinned: bool = True) -> None:
        """A soft pin: the object is evicted only when nothing unpinned can be."""
        self.master.pin(key, pinned)

    def change_replica(self, key: str, num_replicas: int) -> int:
        """Bring `key` to `num_replicas` DRAM replicas (at most one per node); returns how many
        it has now. New replicas are copied by this client from an existing one."""
        if num_replicas < 1:
            raise InvalidRequest(f"num_replicas: must be >= 1, got {num_replicas}")
        meta = self.master.get(key)
        self._release([(key, meta)])  # only counted, not read
        current = len(meta["replicas"])
        if num_replicas < current:
            self.master.drop_replicas(key, num_replicas)
            return num_replicas
        plan = self.master.add_replicas(key, num_replicas)
        targets = plan["targets"]
        if not targets:
            return current
        source = plan["source"]
        data = bytearray(source["size_bytes"])
        versions = [t["version"] for t in targets]
        try:
            self._read(key, source, memoryview(data))
            requests = write_requests(memoryview(data), source["checksum"], targets,
                                      self._use_shared_memory)
            self._transfer(requests)
        except (StoreError, TransferError) as exc:
            self.master.replicas_done(key, versions, False)
            raise TransferFailed(f"change_replica of {key!r} failed: {exc}") from exc
        self.master.replicas_done(key, versions, True)
        return current + len(targets)

    def stats(self) -> dict[str, Any]:
        return self.master.stats()

    # ---- tensors -----------------------------------------------------------------------------------
    def put_tensor(self, key: str, tensor: torch.Tensor) -> bool:
        """Store a CPU tensor with its dtype and shape (read back with `get_tensor`)."""
        tensor = tensor.detach().contiguous()
        meta = msgpack.packb({"dtype": str(tensor.dtype).removeprefix("torch."),
                              "shape": list(tensor.shape)})
        body = buffer_view(tensor, field="tensor")
        return self.put(key, len(meta).to_bytes(4, "little") + meta + bytes(body))

    def get_tensor(self, key: str) -> torch.Tensor:
        import torch

        data = self.get(key)
        meta_len = int.from_bytes(data[:4], "little")
        try:
            meta = msgpack.unpackb(data[4:4 + meta_len])
            dtype = getattr(torch, meta["dtype"])
            shape = tuple(meta["shape"])
        except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException):
            raise InvalidRequest(f"key {key!r} was not stored with put_tensor") from None
        flat = torch.frombuffer(bytearray(data[4 + meta_len:]), dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
