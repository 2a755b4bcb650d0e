"""A worker's components, built from its `WorkerConfig` at `Worker.start()`: the transfer engine,
the engine (or a CPP stage's slice of it), the vLLM-format KV event publisher, the in-process
store node with its client, and the etcd membership. Each function builds and returns; the
worker keeps them and closes them in `Worker.close()`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvcake.engine.engine import Engine
from kvcake.engine.loader import resolve
from kvcake.engine.stage import StageEngine, split_layers
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.decode import pool_allocator
from kvcake.server.worker.kv_event_publisher import KvEventPublisher
from kvcake.store import NodeConfig, StoreClient, StoreNode
from kvcake.store.reader import CACHE_ENTRIES
from kvcake.transfer import TransferConfig, TransferEngine, TransportWrapper

if TYPE_CHECKING:
    from kvcake.server.worker.membership import WorkerMembership

log = logging.getLogger("kvcake.server.worker.worker")  # the worker's log, as before the split


def transfer_engine(cfg: WorkerConfig, wrap_transport: TransportWrapper | None) -> TransferEngine:
    """The worker's transfer engine, not started yet."""
    return TransferEngine(TransferConfig(host=cfg.host, num_rails=2,
                                         advertise_host=cfg.advertise_host,
                                         use_shared_memory=cfg.shared_memory,
                                         secret=cfg.secret),
                          wrap_transport=wrap_transport)


def load_model(cfg: WorkerConfig, transfer: TransferEngine,
               worker_id: str) -> tuple[Engine | None, StageEngine | None]:
    """(the engine, None), or (None, the stage) for role cpp: its slice of the layers. A decode
    engine's KV pool is a segment of `transfer` (shared memory unless `shared_memory` is off)."""
    kv_allocator = pool_allocator(transfer, worker_id, shared=cfg.shared_memory) \
        if cfg.role is Role.DECODE else None
    if cfg.role is Role.CPP:
        layers = split_layers(resolve(cfg.model).config.num_layers, cfg.cpp_nodes)
        return None, StageEngine(cfg.model, layers[cfg.cpp_member or 0], cfg.engine)
    return Engine(cfg.model, cfg.engine, kv_allocator=kv_allocator), None


def kv_event_publisher(cfg: WorkerConfig, worker_id: str,
                       engine: Engine) -> KvEventPublisher | None:
    """vLLM-format KV events (ZMQ PUB) when `kv_events_endpoint` is set."""
    if cfg.kv_events_endpoint is None:
        return None
    publisher = KvEventPublisher(
        cfg.kv_events_endpoint, f"kv@{worker_id}@{engine.model_config.name}",
        engine.block_size, "GPU" if engine.device.type == "cuda" else "CPU")
    log.info("%s: KV events (vLLM KVEventBatch) on %s", worker_id, publisher.endpoint)
    return publisher


def store_node(cfg: WorkerConfig, master: str, worker_id: str,
               transfer: TransferEngine) -> StoreNode:
    """The in-process store node, started: this worker's DRAM in the store pool."""
    return StoreNode(NodeConfig(cfg.store_dram_bytes), master, node_id=f"node-{worker_id}",
                     engine=transfer, host=cfg.host, secret=cfg.secret,
                     advertise_host=cfg.advertise_host).start()


def store_client(cfg: WorkerConfig, master: str, transfer: TransferEngine,
                 node: StoreNode) -> StoreClient:
    return StoreClient(master, engine=transfer,
                       transfer_config=TransferConfig(serve=False, secret=cfg.secret),
                       local_node=node.node_id,
                       # block keys are chained hashes of their tokens: a key's bytes never
                       # change, so a remembered location is safe
                       location_cache=CACHE_ENTRIES)


def etcd_membership(cfg: WorkerConfig, etcd: str,
                    model: Engine | StageEngine) -> WorkerMembership:
    """The worker's etcd membership, not joined yet (`WorkerMembership.join`)."""
    from kvcake.registry import Etcd  # the etcd client only where etcd is used
    from kvcake.server.worker.membership import WorkerMembership

    return WorkerMembership(Etcd(etcd), cfg.cluster, cfg.role.value, model.model_config.name,
                            model.namespace)
