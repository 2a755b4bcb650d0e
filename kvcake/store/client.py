"""`StoreClient`: put and get objects; metadata from the master, bytes through the transfer engine.

    with StoreClient("127.0.0.1:21000") as store:
        store.put("ns:00ab..", data)            # 1. master allocates replicas  2. client writes
        store.get("ns:00ab..") -> bytes         #    each one  3. commit;  get: descriptors from
        store.get_into("ns:00ab..", buffer)     #    the master, bytes read straight from a node

The put path is `ObjectWriter` (writer.py): put_start goes without the checksum, which the client
computes while the master allocates and sends with the commit, acknowledged before `put` returns.
The get path is `ObjectReader` (reader.py): every read is checked (version + xxh3-64 checksum), a
replica that fails is skipped for the next, the master is asked again after every replica failed
(which may say the object is gone: KeyError), and each read lease is released (one-way, sent
with the next request to the master) as soon as the read is over. `get_batch` returns new
`bytes`, `get_batch_into` fills the caller's buffers. On any error the contents of a caller's
destination buffer are undefined. This class owns how bytes move (its transfer engine and direct
path) and the lifecycle.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcake.clock import Clock
from kvcake.store.config import ClientConfig, override
from kvcake.store.direct import DirectPath
from kvcake.store.errors import InvalidRequest, ObjectNotFound, StoreError, TransferFailed
from kvcake.store.forward import ForwardLinks
from kvcake.store.master_api import Master, unwrap
from kvcake.store.reader import ObjectReader
from kvcake.store.remote import RemoteMaster
from kvcake.store.replica_io import write_requests
from kvcake.store.tensors import pack_tensor, unpack_tensor
from kvcake.store.writer import ObjectWriter, WriterOptions
from kvcake.transfer import (
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferRequest,
    TransportWrapper,
    local_host_id,
)

if TYPE_CHECKING:
    import torch

    from kvcake.store.config import EmbeddedConfig
    from kvcake.store.embedded import EmbeddedStore

__all__ = ["Master", "StoreClient"]


class StoreClient:
    """A client of one store. `master` is "HOST:PORT" or an in-process master service.

    The transfer engine starts on first use (or pass a started `engine` to share one). Set
    `transfer_config.use_shared_memory=False` to force TCP even to nodes on this host. A client
    with its own engine moves batches of up to `slice_bytes` on the calling thread (`DirectPath`);
    `wrap_transport` wraps every endpoint of both (tests inject faults with it).
    `config` (`ClientConfig`): replicas per put, this client's node, the location cache and
    async seals; its fields may also be given as keywords (`num_replicas=2`), which override
    those of `config`. `location_cache`: how many keys' locations the reader remembers
    (locations.py; default `CACHE_ENTRIES`, 0: none). A remembered location is read without
    asking the master, checked by the replica's version, xxh3-64 and that its node has not
    revoked it: the master has a node revoke every replica it drops before it acknowledges the
    drop, so such reads stay linearizable with removes, evictions and overwrites by any client
    (master.py); `async_seal`: a small put returns once its one-way seal is sent, not
    acknowledged (writer.py; off by default); `forward_puts` (opt-in): a small put to a separate
    node reached over TCP is one request to that node, which checks the bytes and commits them
    at the master (forward.py; never with `wrap_transport`). `clock`: how old the
    writer's reserved slots are.
    """

    def __init__(self, master: str | Master, config: ClientConfig | None = None, *,
                 engine: TransferEngine | None = None,
                 transfer_config: TransferConfig | None = None,
                 wrap_transport: TransportWrapper | None = None, clock: Clock | None = None,
                 **options: Any) -> None:
        config = override(config or ClientConfig(), options)
        self.config = config
        if isinstance(master, str):  # proves transfer_config.secret to the master, if set
            master = RemoteMaster(master, secret=transfer_config.secret if transfer_config
                                  else None)
        self.master: Master = master
        self._own_engine = engine is None
        self._engine = engine
        self._transfer_config = transfer_config or TransferConfig(serve=False)
        self._wrap = wrap_transport
        # A shared engine is used as it is (it may carry a test's transport wrapper).
        self._direct = DirectPath(self._transfer_config, wrap_transport) if engine is None \
            else None
        self._started = engine is not None
        self.num_replicas = config.num_replicas
        self.local_node = config.local_node
        self._embedded: EmbeddedStore | None = None
        self._start_lock = threading.Lock()
        direct = self._direct is not None
        self._forward = self._forward_links(config) if direct and wrap_transport is None \
            else None
        self._reader = ObjectReader(master, self._transfer,
                                    self._engine_transfer if direct else None,
                                    cache_entries=config.location_cache)
        self._writer = ObjectWriter(master, self._transfer,
                                    WriterOptions(direct=direct, async_seal=config.async_seal),
                                    clock=clock, on_written=self._reader.remember,
                                    forward=self._forward)

    def _forward_links(self, config: ClientConfig) -> ForwardLinks | None:
        """Connections for forwarded puts (forward.py), if this client forwards: only with its
        own direct path and no transport wrapper (a forwarded put's bytes travel on a control
        connection, which no wrapper sees)."""
        if not config.forward_puts:
            return None
        transfer = self._transfer_config
        return ForwardLinks(transfer.secret, transfer.io_timeout_s,
                            local_host_id() if transfer.use_shared_memory else None)

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

    def release_slots(self) -> None:
        """Give back the space reserved for this client's next puts (writer.py; one-way, with
        the next master request). Later puts reserve again; `close` does this too."""
        self._writer.close()

    def close(self) -> None:
        self._writer.close()  # releases its reserved slots (before the master connection goes)
        if self._forward is not None:
            self._forward.close()
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

    # ---- moving bytes --------------------------------------------------------------------------
    def _transfer(self, requests: list[TransferRequest],
                  xxh3_digests: list[int | None] | None = None) -> None:
        """Move a batch: on this thread when it is small (`DirectPath`), else (or if that fails)
        through the engine, which retries on other rails. TransferError if it cannot be moved."""
        direct = self._direct
        if direct is not None and direct.accepts(requests) \
                and direct.transfer(requests, xxh3_digests or ()):
            return
        self.engine.transfer(requests)

    def _engine_transfer(self, requests: list[TransferRequest]) -> None:
        """Through the engine only (its checked path), starting it on first use."""
        self.engine.transfer(requests)

    # ---- put / get -------------------------------------------------------------------------------
    def put(self, key: str, data: Any) -> bool:
        """Store `data` (bytes-like, numpy array, CPU tensor) under `key`. Returns False, writing
        nothing, if the key is already stored or being written (keys name content)."""
        return self._writer.put(key, data, self.num_replicas, self.local_node)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        """Put every (key, value); one master round trip per phase and one transfer batch."""
        return self._writer.put_batch(keys, values, self.num_replicas, self.local_node)

    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound (a KeyError) if the key is not stored."""
        return self._reader.get(key)

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the object into the start of `buffer` (writable, large enough); returns its
        size in bytes."""
        return self._reader.get_into(key, buffer)

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's bytes (new objects), None for a key that is not stored. One master round
        trip and one transfer batch; every read checked, a replica that fails is retried alone.
        Raises TransferFailed if a stored object cannot be read intact at all."""
        return self._reader.get_batch(keys)

    def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        """Read each key into its buffer; returns each size, None for a key that is not stored.
        One master round trip and one transfer batch; a replica that fails its check is retried
        alone. Raises TransferFailed if a stored object cannot be read intact at all."""
        return self._reader.get_batch_into(keys, buffers)

    def _read(self, key: str, meta: dict[str, Any], dest: memoryview,
              whole: memoryview | None = None) -> int:
        """`ObjectReader.read`: one checked read of descriptor `meta` (tests pass stale ones)."""
        return self._reader.read(key, meta, dest, whole)

    # ---- the rest ----------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.master.exists(key)

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return [bool(unwrap(item)) for item in self.master.exists_batch(list(keys))]

    def remove(self, key: str) -> None:
        """Forget `key` (ObjectNotFound if absent). Readers holding a lease finish safely."""
        self._reader.forget([key])
        self.master.remove(key)

    def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        """True for each key removed, False for each that was not stored."""
        self._reader.forget(keys)
        out = []
        for item in self.master.remove_batch(list(keys)):
            try:
                unwrap(item)
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
        self._reader.release([(key, meta)])  # only counted, not read
        current = len(meta["replicas"])
        if num_replicas < current:
            self._reader.forget([key])
            self.master.drop_replicas(key, num_replicas)
            return num_replicas
        plan = self.master.add_replicas(key, num_replicas)
        targets, source = plan["targets"], plan["source"]
        if not targets:
            self._reader.release([(key, source)])
            return current
        data = bytearray(source["size_bytes"])
        versions = [t["version"] for t in targets]
        try:
            self._reader.read(key, source, memoryview(data))  # releases the source's lease
            requests = write_requests(memoryview(data), source["checksum"], targets)
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
        return self.put(key, pack_tensor(tensor))

    def get_tensor(self, key: str) -> torch.Tensor:
        return unpack_tensor(key, self.get(key))
