"""The whole store in one process: a master, one or more nodes and clients sharing one transfer
engine. For tests and single-machine serving; bytes still move only through the engine (here: a
shared-memory copy), and every read is verified exactly as in a cluster.

    with EmbeddedStore(EmbeddedConfig(dram_bytes=1 << 30)) as store:
        client = store.client()
        client.put("k", b"v")
"""

from __future__ import annotations

from typing import Any

from kvcake.clock import Clock
from kvcake.store.client import StoreClient
from kvcake.store.config import EmbeddedConfig
from kvcake.store.master import MasterService
from kvcake.store.node import StoreNode
from kvcake.transfer import TransferConfig, TransferEngine, TransportWrapper


class EmbeddedStore:
    """`clock` drives the master's leases and timeouts (tests pass a ManualClock);
    `wrap_transport` wraps every endpoint of the shared engine (tests inject faults with it)."""

    def __init__(self, config: EmbeddedConfig, *, clock: Clock | None = None,
                 wrap_transport: TransportWrapper | None = None) -> None:
        if not isinstance(config, EmbeddedConfig):
            raise ValueError(f"config: must be an EmbeddedConfig, got {type(config).__name__} "
                             "(e.g. EmbeddedConfig(dram_bytes=1 << 30))")
        self.config = config
        self.master = MasterService(config.master, clock)
        self._clock = clock
        # Nodes are served by their own engine only when a client could not map them; in one
        # process every segment is shared memory, so no server is needed.
        self.engine = TransferEngine(TransferConfig(serve=False, num_rails=1),
                                     wrap_transport=wrap_transport)
        self.nodes = [StoreNode(config.node(i), self.master, node_id=f"node-{i}",
                                engine=self.engine) for i in range(config.num_nodes)]
        self._clients: list[StoreClient] = []

    def start(self) -> EmbeddedStore:
        self.engine.start()
        for node in self.nodes:
            node.start()
        return self

    def client(self, **kwargs: Any) -> StoreClient:
        """A client of this store sharing its engine; kwargs go to `StoreClient`."""
        kwargs.setdefault("clock", self._clock)
        client = StoreClient(self.master, engine=self.engine, **kwargs)
        self._clients.append(client)
        return client

    def close(self) -> None:
        for node in self.nodes:
            node.close(unregister=False)
        self.engine.close()

    def __enter__(self) -> EmbeddedStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
