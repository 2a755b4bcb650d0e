"""A master that hosts a store node in its own process: a small put is one client round trip.

    kvcake store master --port 21000 [--with-node 4GiB]    # master + node "hosted" in one process
                                                           # (the default, 1 GiB; cli.py)

Through a separate master and node, a put is two round trips to two processes (the bytes to the
node, then the commit to the master). Here the client sends `put_inline` (key, size, the
payload's xxh3-64; the payload's raw bytes right behind the frame, protocol.PAYLOAD_OPS) on its
master connection and the hosting process does the rest in-process, with the same two-phase
states the master enforces everywhere:

    put_start (PENDING; placement and eviction exactly as for any put)
    -> the payload received straight into the hosted replica's range (no copy in between)
    -> verified against the client's checksum (as a node checks a write's digest; a mismatch
       revokes the put and answers InvalidRequest)
    -> the header written; any other node's replica written through the hosted node's transfer
       engine (digest-checked over TCP, as a client writes it)
    -> put_commit (COMPLETE, readable), then the reply: the replica descriptors (the client's
       location cache remembers them, so a get is one round trip to the node's segment server)

Any failure after put_start revokes the pending object, so nothing half-written is ever readable.
The placement is the master's (`--strategy`); the hosted node is the put's `local_node` when the
client names none (`local_first` puts there). Other nodes register with this master and work as
with any master; the hosted node leaves the pool only with the process. Clients find the hosted
node in the master's `stats()` ("hosted_node") and use `put_inline` for single puts up to
`max_bytes`; against any other master nothing changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcake.auth import ClusterSecret
from kvcake.clock import Clock
from kvcake.store.config import MasterConfig, NodeConfig
from kvcake.store.errors import InvalidRequest, StoreError, TransferFailed
from kvcake.store.layout import payload_checksum
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode
from kvcake.store.payload import Payload
from kvcake.store.replica_io import write_requests
from kvcake.transfer import TransferConfig, TransferError

log = logging.getLogger(__name__)

INLINE_MAX_BYTES = 4 << 20  # single puts up to this size travel inline (one request)
Receive = Callable[[memoryview], None]  # fills the given range with the payload


class InlinePuts:
    """`put_inline` against `service`, writing the replicas `node` (registered with `service`,
    in this process) holds by memcpy and the others through `node.engine`."""

    def __init__(self, service: MasterService, node: StoreNode,
                 max_bytes: int = INLINE_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be positive, got {max_bytes}")
        self.service = service
        self.node = node
        self.max_bytes = max_bytes

    def describe(self) -> dict[str, Any]:
        """What a client needs to use `put_inline` (the master's stats carry it)."""
        return {"node_id": self.node.node_id, "max_bytes": self.max_bytes}

    def put_inline(self, key: str, size_bytes: int, checksum: int,
                   payload: Receive | Payload, num_replicas: int | None = None,
                   local_node: str | None = None) -> list[dict[str, Any]]:
        """Store the `size_bytes` bytes `payload` brings under `key`, acknowledged; returns the
        replica descriptors. ObjectExists if the key is stored or being written (the payload is
        not read); InvalidRequest for bad input or bytes that do not match `checksum` (nothing
        is stored then)."""
        if size_bytes > self.max_bytes:
            raise InvalidRequest(f"size_bytes: {size_bytes} is over the inline limit of "
                                 f"{self.max_bytes}; use put_start/put_commit")
        receive = payload.read_into if isinstance(payload, Payload) else payload
        descs = self.service.put_start(key, size_bytes, checksum, num_replicas,
                                       local_node or self.node.node_id)
        try:
            self._receive_and_write(key, size_bytes, checksum, receive, descs)
        except BaseException:
            self.service.put_revoke(key)  # PENDING -> gone: never readable
            raise
        self.service.put_commit(key)
        return descs

    def _receive_and_write(self, key: str, size_bytes: int, checksum: int, receive: Receive,
                           descs: list[dict[str, Any]]) -> None:
        """The bytes straight into the hosted replica's range (else a scratch buffer), checked
        against `checksum`, then the hosted header and the other nodes' replicas."""
        here = self.node.node_id
        local = [d for d in descs if d["node_id"] == here]
        remote = [d for d in descs if d["node_id"] != here]
        if local:
            view = self.node.payload_window(local[0]["offset"], size_bytes)
        else:
            view = memoryview(bytearray(size_bytes))
        receive(view)
        if payload_checksum(view) != checksum:
            raise InvalidRequest(f"checksum: the payload of {key!r} does not match it (corrupted "
                                 "on the way, or computed over other bytes)")
        for desc in local[1:]:  # never more than one replica per node; kept general
            self.node.payload_window(desc["offset"], size_bytes)[:] = view
        for desc in local:
            self.node.write_header(desc["offset"], desc["version"], checksum, size_bytes)
        if remote:
            try:
                self.node.engine.transfer(write_requests(view, checksum, remote))
            except (TransferError, ValueError) as exc:
                raise TransferFailed(f"writing {len(remote)} replicas on other nodes "
                                     f"failed: {exc}") from exc


class HostingMasterServer(MasterServer):
    """`MasterServer` that also serves `put_inline` through `puts`, and says in `stats` which
    node it hosts."""

    def __init__(self, service: MasterService, puts: InlinePuts, host: str = "127.0.0.1",
                 port: int = 0, secret: ClusterSecret | None = None,
                 tick_interval_s: float | None = 0.5) -> None:
        super().__init__(service, host, port, tick_interval_s=tick_interval_s, secret=secret)
        self.puts = puts

    def _handle(self, op: str, args: dict[str, Any], session: dict[str, Any]) -> Any:
        if op == "put_inline":
            return self.puts.put_inline(**args)
        result = super()._handle(op, args, session)
        if op == "stats":
            result = {**result, "hosted_node": self.puts.describe()}
        return result


@dataclass(frozen=True)
class HostedConfig:
    """What `HostedStore` runs: the master's config, the hosted node's, where the master listens
    (`host:port`; 0: any port), the node's id, and how often the reaper ticks (None: never;
    tests call `service.tick()`)."""

    master: MasterConfig
    node: NodeConfig
    host: str = "127.0.0.1"
    port: int = 0
    node_id: str | None = None
    tick_interval_s: float | None = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.master, MasterConfig) or not isinstance(self.node, NodeConfig):
            raise ValueError("master, node: must be a MasterConfig and a NodeConfig")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be 0..65535, got {self.port}")
        if self.tick_interval_s is not None and self.tick_interval_s <= 0:
            raise ValueError(f"tick_interval_s: must be > 0 or None, got {self.tick_interval_s}")


class HostedStore:
    """A master and one node in this process (`kvcake store master --with-node`): the master on
    `config.host:config.port`, the node's segment served by its own transfer engine
    (`transfer_config`, default: on `config.host`). `clock` drives the master (tests: a
    ManualClock); `secret` is asked of every connection and proved to other nodes."""

    def __init__(self, config: HostedConfig, *, transfer_config: TransferConfig | None = None,
                 secret: ClusterSecret | None = None, clock: Clock | None = None) -> None:
        self.config = config
        self.service = MasterService(config.master, clock)
        transfer = transfer_config or TransferConfig(host=config.host, secret=secret)
        self.node = StoreNode(config.node, self.service, node_id=config.node_id,
                              transfer_config=transfer, host=config.host, secret=secret)
        self.server = HostingMasterServer(self.service, InlinePuts(self.service, self.node),
                                          config.host, config.port, secret=secret,
                                          tick_interval_s=config.tick_interval_s)

    @property
    def address(self) -> str:
        return self.server.address

    def start(self) -> HostedStore:
        self.node.start()
        try:
            self.server.start()
        except (OSError, ValueError, StoreError):
            self.node.close()
            raise
        return self

    def close(self) -> None:
        self.server.close()
        self.node.close()

    def __enter__(self) -> HostedStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
