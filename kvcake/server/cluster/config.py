"""The description of one serving cluster, from `--prefill N --decode M` or a TOML file.

    model = "tiny"
    mode = "disaggregated"          # or "colocated": every worker prefills and decodes
    [frontend]  host = "127.0.0.1"  port = 8000  served_model_name = ["my-model"]
                max_waiting_requests = 64
    [store]     master_host = "127.0.0.1"  master_port = 0    # the master runs in the frontend
    [engine]    kv_cache_bytes = "64MiB"  block_size = 16     # EngineSettings keys, every worker
    [conductor] policy = "global_cache"  tbt_slo_s = 0.3      # ConductorConfig keys
    [monitor]   worker_timeout_s = 30  store_audit_max_keys = 2048   # MonitorConfig keys
    [security]  secret_file = "cluster.secret"   # or secret_env = "NAME"; neither: a fresh one
    [[workers]] role = "prefill"  count = 2                   # launched here, ports from the OS
    [[workers]] role = "decode"   host = "10.0.0.7"  port = 24100  launch = false   # started
                                  # on its host with `kvcake worker --role decode --port 24100
                                  # --master FRONTEND:PORT`; the frontend connects to it

`docs/cluster.example.toml` is a complete example. Unknown keys are errors that name the key.
The `[engine]` keys and the per-worker keys are those of `kvcake/server/cluster/settings.py`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcake.conductor import ConductorConfig, Policy
from kvcake.engine.config import EngineConfig
from kvcake.server.cluster.monitor import MonitorConfig
from kvcake.server.cluster.settings import EngineSettings, WorkerSettings, build
from kvcake.server.worker.config import Role


@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks (launched workers only)
    launch: bool = True  # False: already running at host:port
    store_dram_bytes: int = 64 * 2**20
    num_threads: int | None = 1
    layerwise: bool = True  # prefill: stream KV layer by layer during compute (else after)
    shared_memory: bool = True  # same-host KV and store bytes through shared memory (else TCP)
    kv_events_endpoint: str | None = None  # vLLM-format KV events: ZMQ PUB bound here
    metrics_port: int | None = None  # the worker's own /metrics (0: any port)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(f"workers.role: must be prefill, decode, colocated or cpp, got "
                             f"{self.role!r}") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"workers.port: must be in [0, 65535], got {self.port}")
        if not self.launch and self.port == 0:
            raise ValueError("workers.port: a worker with launch = false needs its port")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "tiny"
    mode: str = "disaggregated"
    host: str = "127.0.0.1"  # the HTTP frontend
    port: int = 8000
    master_host: str = "127.0.0.1"
    master_port: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    workers: tuple[WorkerSpec, ...] = ()
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # pings, store audit
    profile_dir: str | None = None  # None: kvcake.server.cluster.profiler.default_cache_dir()
    max_waiting_requests: int | None = None  # 429 while this many wait for a first token
    served_model_names: tuple[str, ...] = ()  # (): the model's own name
    # each launched worker on CPUs of its own when there are enough (cpu_pinning.py); on by
    # default: unpinned, how often the decode worker shared a CPU with the prefill worker varied
    # between invocations and moved its TBT p50 24.7-58 ms (docs/benchmarks.md, eleventh
    # session); false for a host whose cores other tenants occupy
    pin_workers: bool = True
    # [security]: where the cluster secret is (a file, or an environment variable's name);
    # neither: `kvcake serve` makes one for the workers it launches (launch = false needs one).
    secret_file: str | None = None
    secret_env: str | None = None
    # [etcd]: endpoints "HOST:PORT" of the etcd that holds membership; workers then join by
    # registering there (any number, from any host), and the store master is the elected one.
    etcd_endpoints: tuple[str, ...] = ()
    etcd_cluster: str = "kvcake"

    @property
    def etcd(self) -> str | None:
        """The endpoints as one "HOST:PORT,HOST:PORT" string (None without etcd)."""
        return ",".join(self.etcd_endpoints) if self.etcd_endpoints else None

    def __post_init__(self) -> None:
        if self.etcd_endpoints:
            from kvcake.registry.etcd import parse_endpoints

            parse_endpoints(list(self.etcd_endpoints), "[etcd] endpoints / --etcd")
            if self.mode != "disaggregated":
                raise ValueError("[etcd]: workers join through etcd in mode disaggregated only")
        if self.secret_file and self.secret_env:
            raise ValueError("[security]: give secret_file or secret_env, not both")
        if not (self.secret_file or self.secret_env) and any(not w.launch for w in self.workers):
            raise ValueError("[security]: a worker with launch = false needs the cluster secret "
                             "shared with it: set secret_file (a file readable by its owner "
                             "only) or secret_env (an environment variable's name), and start "
                             "that worker with the same --secret-file / --secret-env")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode: must be disaggregated or colocated, got {self.mode!r}")
        roles = [w.role for w in self.workers]
        self._check_cpp(roles)
        if self.mode == "disaggregated" and not self.etcd_endpoints:
            if Role.PREFILL not in roles or Role.DECODE not in roles:
                raise ValueError("workers: a disaggregated cluster needs at least one prefill "
                                 "and one decode worker (--prefill N --decode M)")
        if self.mode == "disaggregated":
            if Role.COLOCATED in roles:
                raise ValueError("workers: colocated workers belong in mode = \"colocated\"")
        elif not roles or any(r is not Role.COLOCATED for r in roles):
            raise ValueError("workers: mode colocated needs only colocated workers")
        if self.mode == "colocated" and self.conductor.policy is not Policy.COLOCATED:
            object.__setattr__(self, "conductor", ConductorConfig.from_dict(
                {**_conductor_dict(self.conductor), "policy": Policy.COLOCATED}))
        for name in ("port", "master_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: must be in [0, 65535], got {getattr(self, name)}")

    def _check_cpp(self, roles: list[Role]) -> None:
        """Chunked pipeline parallelism: one group of `cpp_nodes` dedicated members (role cpp,
        each a slice of the layers) beside the plain prefill workers, which take the prompts
        below `cpp_min_tokens`."""
        cpp = self.conductor
        members = roles.count(Role.CPP)
        if cpp.cpp_min_tokens is None:
            if members:
                raise ValueError("[[workers]] role cpp: set [conductor] cpp_min_tokens (prompts "
                                 "of at least that many tokens go to the CPP group), or remove "
                                 "the cpp workers")
            return
        if self.mode != "disaggregated":
            raise ValueError("[conductor] cpp_min_tokens: chunked pipeline parallelism needs "
                             "mode disaggregated (a CPP group streams its KV to a decode worker)")
        if self.etcd_endpoints:
            raise ValueError("[conductor] cpp_min_tokens: a CPP group does not join through etcd "
                             "yet; serve it without [etcd] / --etcd (stages on other hosts: "
                             "[[workers]] role = \"cpp\" with launch = false)")
        if members != cpp.cpp_nodes:
            raise ValueError(f"[conductor] cpp_min_tokens: the CPP group needs cpp_nodes = "
                             f"{cpp.cpp_nodes} workers of role cpp (--cpp-nodes X launches "
                             f"them), this cluster has {members}")
        from kvcake.engine.loader import resolve  # the model's shape: its number of layers

        num_layers = resolve(self.model).config.num_layers
        if cpp.cpp_nodes > num_layers:
            raise ValueError(f"[conductor] cpp_nodes / --cpp-nodes: {cpp.cpp_nodes} stages for a "
                             f"{num_layers}-layer model; use 2..{num_layers}")

    @classmethod
    def simple(cls, num_prefill: int, num_decode: int, cpp_nodes: int = 0,
               **options: Any) -> ClusterConfig:
        """`num_prefill` prefill + `num_decode` decode workers on this host (mode
        colocated: `num_prefill` colocated workers), plus `cpp_nodes` CPP members (one group;
        `options["conductor"]` must turn CPP on with the same `cpp_nodes`)."""
        if not options.get("etcd_endpoints") and (
                num_prefill < 1 or (options.get("mode", "disaggregated") == "disaggregated"
                                    and num_decode < 1)):
            raise ValueError(f"--prefill / --decode: need at least 1 of each, got "
                             f"{num_prefill} and {num_decode}")
        worker_opts = options.pop("worker", {})
        if options.get("mode") == "colocated":
            specs = [WorkerSpec(Role.COLOCATED, **worker_opts) for _ in range(num_prefill)]
        else:
            specs = [WorkerSpec(Role.PREFILL, **worker_opts) for _ in range(num_prefill)]
            specs += [WorkerSpec(Role.DECODE, **worker_opts) for _ in range(num_decode)]
            specs += [WorkerSpec(Role.CPP, **worker_opts) for _ in range(cpp_nodes)]
        return cls(workers=tuple(specs), **options)

    @classmethod
    def from_toml(cls, path: str | Path) -> ClusterConfig:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML ({exc})") from None
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ClusterConfig:
        known = {"model", "mode", "frontend", "store", "engine", "conductor", "monitor",
                 "workers", "profile_dir", "security", "etcd", "pin_workers"}
        _no_unknown(raw, known, source)
        frontend = dict(raw.get("frontend", {}))
        _no_unknown(frontend, {"host", "port", "max_waiting_requests", "served_model_name"},
                    f"{source} [frontend]")
        store = dict(raw.get("store", {}))
        security = dict(raw.get("security", {}))
        _no_unknown(security, {"secret_file", "secret_env"}, f"{source} [security]")
        _no_unknown(store, {"master_host", "master_port"}, f"{source} [store]")
        etcd = dict(raw.get("etcd", {}))
        _no_unknown(etcd, {"endpoints", "cluster"}, f"{source} [etcd]")
        engine = build(EngineSettings, dict(raw.get("engine", {})), "[engine]").to_config()
        workers: list[WorkerSpec] = []
        for entry in raw.get("workers", []):
            entry = dict(entry)
            count = entry.pop("count", 1)
            _no_unknown(entry, {f.name for f in fields(WorkerSpec)}, f"{source} [[workers]]")
            given = {k: v for k, v in entry.items() if k in WorkerSettings.model_fields}
            entry.update(build(WorkerSettings, given, "[[workers]]").model_dump(include=set(given)))
            if count > 1 and entry.get("port", 0):
                raise ValueError(f"{source} [[workers]]: count > 1 needs port = 0")
            workers += [WorkerSpec(**entry) for _ in range(count)]
        return cls(model=raw.get("model", "tiny"), mode=raw.get("mode", "disaggregated"),
                   host=frontend.get("host", "127.0.0.1"), port=frontend.get("port", 8000),
                   master_host=store.get("master_host", "127.0.0.1"),
                   master_port=store.get("master_port", 0),
                   engine=engine,
                   conductor=ConductorConfig.from_dict(raw.get("conductor", {})),
                   monitor=MonitorConfig.from_dict(raw.get("monitor", {})),
                   workers=tuple(workers), profile_dir=raw.get("profile_dir"),
                   secret_file=security.get("secret_file"),
                   secret_env=security.get("secret_env"),
                   max_waiting_requests=frontend.get("max_waiting_requests"),
                   served_model_names=_names(frontend.get("served_model_name", ())),
                   etcd_endpoints=_names(etcd.get("endpoints", ())),
                   etcd_cluster=etcd.get("cluster", "kvcake"),
                   pin_workers=_flag(raw.get("pin_workers", True), f"{source}: pin_workers"))


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: must be true or false, got {value!r}")
    return value


def _names(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _conductor_dict(config: ConductorConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def _no_unknown(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known keys are {sorted(known)}")
