"""Frozen, validated configs of the store master, a store node, an elected master and a client.
The CLI reads its defaults here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

CACHE_ENTRIES = 1 << 15  # keys whose location a reader remembers by default (~200 bytes each)


class Strategy(StrEnum):
    """How the master picks the segments of a new object's replicas."""

    RANDOM = "random"
    LOCAL_FIRST = "local_first"  # the writer's own node first, then most free
    MOST_FREE_FIRST = "most_free_first"


@dataclass(frozen=True)
class MasterConfig:
    """Policy knobs of the metadata master. Times are seconds on the master's injected clock."""

    high_watermark: float = 0.95  # evict when DRAM use of the pool exceeds this share ...
    low_watermark: float = 0.85  # ... down to this share
    put_timeout_s: float = 30.0  # an allocation not committed by then is reclaimed
    lease_s: float = 5.0  # a get protects the object from eviction and reuse this long
    heartbeat_timeout_s: float = 10.0  # a node silent this long is dead
    # a get of an object whose writer named it and is sealing it (writer.py) waits this long,
    # in real seconds, for the seal before it answers ObjectNotFound
    seal_wait_s: float = 2.0
    default_replicas: int = 1
    strategy: Strategy = Strategy.MOST_FREE_FIRST
    alignment_bytes: int = 64
    max_key_len: int = 1024
    seed: int = 0  # for the random strategy

    def __post_init__(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                "watermarks: need 0 < low_watermark <= high_watermark <= 1, got "
                f"low_watermark={self.low_watermark}, high_watermark={self.high_watermark}"
            )
        for name in ("put_timeout_s", "lease_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.seal_wait_s <= 60.0:
            raise ValueError(f"seal_wait_s: must be in [0, 60], got {self.seal_wait_s}")
        if self.default_replicas < 1:
            raise ValueError(f"default_replicas: must be >= 1, got {self.default_replicas}")
        if self.alignment_bytes < 1 or self.alignment_bytes & (self.alignment_bytes - 1):
            raise ValueError(f"alignment_bytes: must be a power of two, got {self.alignment_bytes}")
        if self.max_key_len < 1:
            raise ValueError(f"max_key_len: must be >= 1, got {self.max_key_len}")
        object.__setattr__(self, "strategy", Strategy(self.strategy))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MasterConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class NodeConfig:
    """One store node: its DRAM segment and optional SSD tier, and where it serves its control
    port: `host` (bind address; also its transfer engine's unless a transfer config is given) and
    `advertise_host`, what the master dials (default: `host`). `prefault`: the segment's pages
    are made resident at start (prefault.py), so no put pays their first-touch faults. Off by
    default here (a worker's or an embedded store's node shares its machine with an engine: its
    memory is taken as objects land); on for a dedicated node (`kvcake store node`, `kvcake
    store master --with-node`; `--no-prefault` turns it off)."""

    dram_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0
    heartbeat_interval_s: float = 1.0
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    prefault: bool = False

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must be an address to bind, e.g. 127.0.0.1 or 0.0.0.0")
        if self.advertise_host == "":
            raise ValueError("advertise_host: must be an address peers can dial, or None")
        if self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes: must be > 0, got {self.dram_bytes}")
        if self.disk_bytes < 0:
            raise ValueError(f"disk_bytes: must be >= 0, got {self.disk_bytes}")
        if self.disk_bytes > 0 and not self.disk_dir:
            raise ValueError("disk_dir: a disk tier of disk_bytes > 0 needs a directory")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(
                f"heartbeat_interval_s: must be > 0, got {self.heartbeat_interval_s}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class EmbeddedConfig:
    """The whole store in one process (`EmbeddedStore`): a master with policy `master` and
    `num_nodes` nodes of `dram_bytes` each, with a disk tier of `disk_bytes` each under
    `disk_dir`/node-<i> when `disk_dir` is given."""

    dram_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0
    num_nodes: int = 1
    master: MasterConfig = field(default_factory=MasterConfig)

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes: must be >= 1, got {self.num_nodes}")
        if not isinstance(self.master, MasterConfig):
            raise ValueError(f"master: must be a MasterConfig, got {type(self.master).__name__}")
        self.node(0)  # the node fields are checked as NodeConfig checks them

    def node(self, index: int) -> NodeConfig:
        """The config of node `index`."""
        if self.disk_dir:
            return NodeConfig(self.dram_bytes, f"{self.disk_dir}/node-{index}", self.disk_bytes)
        return NodeConfig(self.dram_bytes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmbeddedConfig:
        data = dict(data)
        if isinstance(data.get("master"), dict):
            data["master"] = MasterConfig.from_dict(data["master"])
        return _from_dict(cls, data)


@dataclass(frozen=True)
class ElectionConfig:
    """How an `ElectedMaster` (elected.py) serves and stands for election."""

    host: str = "127.0.0.1"  # the RPC port's interface
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # what peers dial (in etcd); None: `host`
    recovery_s: float = 10.0  # once elected, client requests wait at most this long for nodes
    lease_ttl_s: int = 2  # the etcd lease behind the leadership key
    tick_interval_s: float | None = 0.5  # the reaper thread's period; None: no reaper

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must be a non-empty interface address")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.recovery_s < 0:
            raise ValueError(f"recovery_s: must be >= 0, got {self.recovery_s}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s: must be >= 1, got {self.lease_ttl_s}")
        if self.tick_interval_s is not None and self.tick_interval_s <= 0:
            raise ValueError(f"tick_interval_s: must be > 0 or None, got {self.tick_interval_s}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ElectionConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class ClientConfig:
    """How a `StoreClient` (client.py) places its puts and remembers locations."""

    num_replicas: int | None = None  # DRAM replicas per put; None: the master's default_replicas
    local_node: str | None = None  # this client's node, first for the local_first strategy
    # keys whose location the reader remembers (locations.py); 0: none
    location_cache: int = CACHE_ENTRIES
    async_seal: bool = False  # a small put returns once its one-way seal is sent (writer.py)
    # opt-in: an acknowledged slot put to a node with a forward port is one request to it
    # (forward.py; off by default: measured slower than the two-round-trip put at load 5-6)
    forward_puts: bool = False

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas: must be >= 1 or None, got {self.num_replicas}")
        if self.location_cache < 0:
            raise ValueError(f"location_cache: must be >= 0, got {self.location_cache}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClientConfig:
        return _from_dict(cls, data)


_Config = TypeVar("_Config", ElectionConfig, ClientConfig, NodeConfig)


def override(config: _Config, options: dict[str, Any]) -> _Config:
    """`config` with the fields named in `options` replaced (validated again); unknown keys are
    errors, as in `from_dict`."""
    if not options:
        return config
    _check_keys(type(config), options)
    return dataclasses.replace(config, **options)


def _check_keys(cls: Any, data: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known keys are {sorted(known)}")


def _from_dict(cls: Any, data: dict[str, Any]) -> Any:
    _check_keys(cls, data)
    return cls(**data)
