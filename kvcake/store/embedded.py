"""The whole store in one process: a master, one or more nodes and clients sharing one transfer
engine. For tests and single-machine serving; bytes still move only through the engine (here: a
shared-memory copy), and every read is verified exactly as in a cluster.

    with EmbeddedStore(dram_bytes=1 << 30) as store:
        client = store.client()
        client.put("k", b"v")
"""

from __future__ import annotations

from typing import Any

from kvcake.clock import Clock
from kvcake.store.client import StoreClient
from kvcake.store.config import MasterConfig, NodeConfig
from kvcake.store.master import MasterService
from kvcake.store.node import StoreNode
from kvcake.transfer import TransferConfig, TransferEngine, TransportWrapper


class EmbeddedStore:
    def __init__(self, dram_bytes: int, *, disk_dir: str | None = None, disk_bytes: int = 0,
                 config: MasterConfig | None = None, clock: Clock | None = None,
                 num_nodes: int = 1, wrap_transport: TransportWrapper | None = None) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes: must be >= 1, got {num_nodes}")
        self.master = MasterService(config, clock)
        # Nodes are served by their own engine only when a client could not map them; in one
        # process every segment is shared memory, so no server is needed.
        self.engine = TransferEngine(TransferConfig(serve=False, num_rails=1),
                                     wrap_transport=wrap_transport)
        self.nodes = [
            StoreNode(NodeConfig(dram_bytes, f"{disk_dir}/node-{i}" if disk_dir else None,
                                 disk_bytes if disk_dir else 0),
                      self.master, node_id=f"node-{i}", engine=self.engine)
            for i in range(num_nodes)
        ]
        self._clients: list[StoreClient] = []

    def start(self) -> EmbeddedStore:
        self.engine.start()
        for node in self.nodes:
            node.start()
        return self

    def client(self, **kwargs: Any) -> StoreClient:
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
