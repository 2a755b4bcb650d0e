"""Mooncake Store: a pool of DRAM (and SSD) segments with a metadata-only master.

    from kvcake.store import StoreClient
    with StoreClient("127.0.0.1:21000") as store:       # a running `kvcake store master`
        store.put("key", data); store.get("key")
    with StoreClient.embedded(1 << 30) as store:   # everything in this process (EmbeddedConfig)
        ...

Modules: index (pure metadata and lifecycle), space (replica ranges, versions, deferred frees),
tiering (eviction, demote / promote plans), slots (keyless allocations), leases (read leases),
eviction (LRU order), allocator (segment ranges), placement (strategies), layout (object header +
checksum), protocol / rpc_server (control frames), master (the service), master_server (its
TCP server), node_handle (the master's handles on nodes), master_args (its list arguments), node,
disk (SSD tier), client, master_api (what the client needs of a master), writer (put path), reader (checked get path),
locations (the reader's location cache), tensors, direct (small transfers on the caller's
thread), remote, embedded, elected, config, cli.
"""

from kvcake.store.client import StoreClient
from kvcake.store.config import (
    ClientConfig,
    ElectionConfig,
    EmbeddedConfig,
    MasterConfig,
    NodeConfig,
    Strategy,
)
from kvcake.store.embedded import EmbeddedStore
from kvcake.store.errors import (
    InvalidRequest,
    MasterUnavailable,
    NoNodes,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    ObjectUnavailable,
    StoreError,
    TransferFailed,
)
from kvcake.store.master import MasterService
from kvcake.store.master_server import MasterServer
from kvcake.store.node import StoreNode

__all__ = [
    "ClientConfig", "ElectionConfig", "EmbeddedConfig", "EmbeddedStore", "InvalidRequest", "MasterConfig", "MasterServer",
    "MasterService",
    "MasterUnavailable", "NoNodes", "NoSpace", "NodeConfig", "ObjectExists", "ObjectNotFound",
    "ObjectUnavailable", "StoreClient", "StoreError", "StoreNode", "Strategy", "TransferFailed",
]
