"""A worker's settings: its `Role` and `WorkerConfig` (no engine imported, so the cluster's
configuration can name roles without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvcake.auth import ClusterSecret
from kvcake.engine.config import EngineConfig


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefills and decodes, local prefix cache only (the baseline)
    CPP = "cpp"  # one stage of a chunked-pipeline-parallel prefill group: a slice of the layers


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker; `kvcake worker` reads its defaults from here."""

    role: Role = Role.PREFILL
    model: str = "tiny"
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # what the control port and segment servers bind
    port: int = 0  # control port; 0: the OS picks
    advertise_host: str | None = None  # what other hosts dial (None: `host`)
    # etcd endpoints "HOST:PORT[,HOST:PORT]": the worker registers there (worker/membership.py)
    # and a frontend watching `cluster` takes it in; its store master is then the elected one.
    etcd: str | None = None
    cluster: str = "kvcake"
    worker_id: str | None = None  # None: role + random suffix
    master: str | None = None  # store master HOST:PORT; None: no store (no reuse across workers)
    store_dram_bytes: int = 64 * 2**20  # DRAM this worker contributes to the store pool
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    layerwise: bool = True  # prefill: stream layer by layer during compute (else after it)
    # Same-host KV by memcpy: a decode worker's KV pool is a shared-memory segment, and this
    # worker's transfer engine maps same-host segments. False: private pool, TCP only.
    shared_memory: bool = True
    # vLLM-format KV events (worker/kv_event_publisher.py) on a ZMQ PUB socket bound here
    # (tcp://HOST:PORT, or tcp://HOST:* for any port); None: not published.
    kv_events_endpoint: str | None = None
    metrics_port: int | None = None  # this worker's own /metrics (0: any port); None: none
    log_level: str = "info"  # launched workers: the frontend's level
    # Role CPP: this worker is stage `cpp_member` (0-based) of a group of `cpp_nodes`; it loads
    # only its slice of the layers (`split_layers`) and takes hidden states in chunks of up to
    # `cpp_chunk_tokens` tokens (the size of each inbox slot).
    cpp_member: int | None = None
    cpp_nodes: int = 2
    cpp_chunk_tokens: int = 1024
    # The cluster secret (`kvcake.auth`): the control port admits only a frontend that proves
    # it, and the store node and segment servers ask it of every peer. None: open ports.
    secret: ClusterSecret | None = field(default=None, repr=False)

    @property
    def store_master(self) -> str | None:
        """The store master to use: `master`, else with etcd the elected one, else none."""
        if self.master is not None or self.etcd is None:
            return self.master
        return f"etcd://{self.etcd}/{self.cluster}"

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", _role(self.role))
        if self.role is Role.CPP:
            if self.cpp_nodes < 2:
                raise ValueError(f"cpp_nodes: a CPP group has >= 2 members, got {self.cpp_nodes}")
            if self.cpp_member is None or not 0 <= self.cpp_member < self.cpp_nodes:
                raise ValueError(f"cpp_member: role cpp needs this worker's stage in [0, "
                                 f"{self.cpp_nodes}) (--cpp-member), got {self.cpp_member}")
            if self.cpp_chunk_tokens < 1:
                raise ValueError(f"cpp_chunk_tokens: must be >= 1, got {self.cpp_chunk_tokens}")
        elif self.cpp_member is not None:
            raise ValueError(f"cpp_member: only a worker of role cpp is a group stage (this one "
                             f"is {self.role.value})")
        if self.etcd is not None and self.role is Role.CPP:
            raise ValueError("etcd: a CPP stage does not join through etcd yet; list it in the "
                             "frontend's cluster file ([[workers]] role = \"cpp\", launch = "
                             "false, its host and port)")
        if self.etcd is not None and self.role is Role.COLOCATED:
            raise ValueError("etcd: only prefill and decode workers join a cluster through etcd")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.store_dram_bytes < 1:
            raise ValueError(f"store_dram_bytes: must be >= 1, got {self.store_dram_bytes}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        if self.secret is not None and not isinstance(self.secret, ClusterSecret):
            raise ValueError("secret: must be a ClusterSecret or None (load one with "
                             "ClusterSecret.load(file=..., env=...))")


def _role(value: object) -> Role:
    try:
        return Role(str(value))
    except ValueError:
        raise ValueError(f"role: must be one of {', '.join(r.value for r in Role)}, "
                         f"got {value!r}") from None
