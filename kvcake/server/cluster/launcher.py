"""Starts and stops the processes of one cluster; `serve_disaggregated` runs one for `kvcake serve`.

    with Cluster(ClusterConfig.simple(1, 1)) as cluster:    # master, workers, Conductor
        cluster.backend                                     # a DisaggBackend to serve
        cluster.kill_worker(worker_id)                      # fault injection: SIGKILL

`Cluster.start()`: the store master in this process (disaggregated mode), every worker with
`launch = true` as a child process `python -m kvcake worker ...` (or as threads in this process
with `in_process=True`, for tests), the cached profile (measured on first use), then the
backend connects to every worker. `close()` shuts the workers down (SIGTERM, then SIGKILL after a
grace period) and stops the master: no orphans. Children also exit when this process dies (they
watch their parent's pid). With `pin_workers = true` (the default) and a CPU per worker
thread, each launched worker runs on CPUs of its own (cpu_pinning.py); this process stays
unpinned.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from kvcake import auth
from kvcake.auth import ClusterSecret
from kvcake.server.cluster.backend import DisaggBackend, DisaggConfig
from kvcake.server.cluster.config import ClusterConfig, WorkerSpec
from kvcake.server.cluster.cpu_pinning import plan_cpus
from kvcake.server.cluster.membership import EtcdWorkers, start_membership
from kvcake.server.cluster.profiler import load_or_profile
from kvcake.server.cluster.restart_policy import RestartPolicy
from kvcake.server.cluster.settings import (
    WorkerSettings,
    current_log_level,
    worker_argv_settings,
)
from kvcake.server.cluster.supervisor import Relaunch, Supervisor
from kvcake.server.frontend.limits import HttpLimits
from kvcake.server.worker.config import Role, WorkerConfig
from kvcake.server.worker.worker import Worker
from kvcake.store import MasterServer, MasterService
from kvcake.store.metrics import StoreMasterCollector

log = logging.getLogger(__name__)

_READY_PREFIX = "kvcake worker ready"
_START_TIMEOUT_S = 120.0


class Cluster:
    def __init__(self, config: ClusterConfig, *, in_process: bool = False,
                 restart: RestartPolicy | None = None) -> None:
        """`restart`: how launched worker processes that die are restarted (supervisor.py)."""
        self.config = config
        self.in_process = in_process
        self.restart = restart or RestartPolicy()
        self.supervisor: Supervisor | None = None  # started once the backend serves
        self._specs: dict[str, WorkerSpec] = {}  # launched worker id -> its spec (restarts)
        # CPP member id (its launcher id) -> its stage in the group: the cpp workers in order
        cpp_ids = [f"cpp-{i}" for i, w in enumerate(config.workers) if w.role is Role.CPP]
        self._stage_of = {worker_id: stage for stage, worker_id in enumerate(cpp_ids)}
        self.master: MasterServer | None = None
        self.backend: DisaggBackend | None = None
        self.membership: EtcdWorkers | None = None  # with etcd: the watch of its workers
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self._cpus: dict[str, tuple[int, ...]] = {}  # launched worker id -> its CPUs (pinned)
        self.workers: dict[str, Worker] = {}  # in-process workers
        self.addresses: dict[str, str] = {}  # worker id -> control address
        # [security] secret_file / secret_env, else a fresh one: every internal port (store
        # master, nodes, segment servers, worker control) admits only peers that prove it.
        self.secret = ClusterSecret.load(file=config.secret_file, env=config.secret_env) \
            or ClusterSecret.generate()

    def start(self) -> Cluster:
        cfg = self.config
        try:
            if cfg.mode == "disaggregated" and cfg.etcd is None:  # etcd: the elected one
                self.master = MasterServer(MasterService(), cfg.master_host,
                                           cfg.master_port, secret=self.secret).start()
            self._cpus = self._cpu_plan()
            for i, spec in enumerate(cfg.workers):  # children start in parallel
                worker_id = f"{spec.role.value}-{i}"
                if spec.launch:
                    self._launch(worker_id, spec)
                else:
                    self.addresses[worker_id] = f"{spec.host}:{spec.port}"
            for worker_id, proc in self.processes.items():
                self.addresses[worker_id] = _await_ready(worker_id, proc)
            threads = next((w.num_threads for w in cfg.workers if w.num_threads), None)
            profile = load_or_profile(cfg.model, cfg.engine,
                                      Path(cfg.profile_dir) if cfg.profile_dir else None,
                                      num_threads=threads)
            self.backend = DisaggBackend(self.backend_config(), profile.prefill,
                                         profile.decode).start()
            if self.master is not None:  # the store master's metrics join the frontend's
                self.backend.collectors.append(StoreMasterCollector(self.master.service.stats))
            if cfg.etcd is not None:  # workers join (and leave) through etcd from now on
                self.membership = start_membership(self.backend, cfg.etcd, cfg.etcd_cluster,
                                                   list(self.processes) + list(self.workers))
            if self.processes:
                self.supervisor = Supervisor(self.processes, self.backend,
                                             Relaunch(self._relaunch, _await_ready),
                                             self.restart).start()
        except BaseException:
            self.close()
            raise
        return self

    def backend_config(self) -> DisaggConfig:
        """The frontend's settings of this cluster (the workers started so far)."""
        cfg = self.config
        return DisaggConfig(
            model=cfg.model, workers_join=cfg.etcd is not None,
            worker_addresses=() if cfg.etcd else tuple(self.addresses.values()),
            conductor=cfg.conductor, monitor=cfg.monitor, store_master=self.master_address,
            secret=self.secret, max_waiting_requests=cfg.max_waiting_requests,
            served_model_names=cfg.served_model_names)

    @property
    def master_address(self) -> str | None:
        if self.config.etcd is not None:
            return f"etcd://{self.config.etcd}/{self.config.etcd_cluster}"
        return self.master.address if self.master is not None else None

    def worker_config(self, worker_id: str, spec: WorkerSpec) -> WorkerConfig:
        cpp: dict[str, Any] = {}
        if spec.role is Role.CPP:  # its stage: its place among the cluster's cpp workers
            conductor = self.config.conductor
            cpp = {"cpp_member": self._stage_of[worker_id], "cpp_nodes": conductor.cpp_nodes,
                   "cpp_chunk_tokens": conductor.cpp_chunk_tokens}
        return WorkerConfig(role=spec.role, model=self.config.model, engine=self.config.engine,
                            **cpp,
                            host=spec.host, port=spec.port, worker_id=worker_id,
                            master=self.master_address if spec.role is not Role.COLOCATED
                            else None,
                            secret=self.secret, etcd=self.config.etcd,
                            cluster=self.config.etcd_cluster, log_level=current_log_level(),
                            **{name: getattr(spec, name) for name in WorkerSettings.model_fields})

    def _launch(self, worker_id: str, spec: WorkerSpec) -> None:
        self._specs[worker_id] = spec
        config = self.worker_config(worker_id, spec)
        if self.in_process:
            worker = Worker(config).start()
            self.workers[worker_id] = worker
            self.addresses[worker_id] = worker.address
            return
        # The secret travels in the child's environment, never on its command line (which
        # every user of the host can read).
        env = {**os.environ, auth.ENV_VAR: self.secret.text()}
        proc = subprocess.Popen(worker_argv(config, os.getpid()), stdout=subprocess.PIPE,
                                text=True, start_new_session=True, env=env)
        cpus = self._cpus.get(worker_id)
        if cpus is not None:  # before the child has started any thread (its imports take
            try:              # far longer): every thread it starts inherits the mask
                os.sched_setaffinity(proc.pid, cpus)
            except OSError as exc:  # it exited already: the ready wait reports that
                log.warning("worker %s: could not pin to CPUs %s (%s)", worker_id, cpus, exc)
        self.processes[worker_id] = proc

    def _cpu_plan(self) -> dict[str, tuple[int, ...]]:
        """Launched worker id -> its own CPUs (`cpu_pinning.plan_cpus`), or {} (unpinned)."""
        if self.in_process or not self.config.pin_workers or \
                not hasattr(os, "sched_setaffinity"):
            return {}
        launched = [(f"{spec.role.value}-{i}", spec.num_threads)
                    for i, spec in enumerate(self.config.workers) if spec.launch]
        plan = plan_cpus([n for _, n in launched], sorted(os.sched_getaffinity(0)))
        if plan is None:
            log.info("workers not pinned: %d CPUs for worker threads %s",
                     len(os.sched_getaffinity(0)), [n for _, n in launched])
            return {}
        pinned = {wid: cpus for (wid, _), cpus in zip(launched, plan, strict=True)}
        log.info("workers pinned to CPUs: %s", pinned)
        return pinned

    def _relaunch(self, worker_id: str) -> subprocess.Popen[str]:
        """A new process for launched worker `worker_id` (the supervisor's restarts)."""
        self._launch(worker_id, self._specs[worker_id])
        return self.processes[worker_id]

    def signal_worker(self, worker_id: str, signum: int) -> int:
        """Send `signum` (SIGSTOP, SIGCONT, SIGKILL: fault injection) to a launched worker's
        current process; returns its pid."""
        proc = self.processes.get(worker_id)
        if proc is None:
            raise ValueError(f"worker: {worker_id!r} is not a process this cluster launched")
        proc.send_signal(signum)
        return proc.pid

    def kill_worker(self, worker_id: str) -> None:
        """SIGKILL a launched worker (fault injection; its store node dies with it)."""
        proc = self.processes.get(worker_id)
        if proc is None:
            raise ValueError(f"worker: {worker_id!r} is not a process this cluster launched")
        proc.kill()
        proc.wait(timeout=10)

    def close(self) -> None:
        if self.supervisor is not None:  # no restarts while the cluster stops
            self.supervisor.close()
            self.supervisor = None
        if self.membership is not None:
            self.membership.close()
            self.membership = None
        if self.backend is not None:  # workers it did not launch keep running
            self.backend.close()
            self.backend = None
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        self.processes.clear()
        if self.master is not None:
            self.master.close()
            self.master = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_argv(config: WorkerConfig, parent_pid: int | None) -> list[str]:
    """`kvcake worker` with every setting of `config` (derived from cluster/settings.py)."""
    argv = [sys.executable, "-m", "kvcake", "worker", *worker_argv_settings(config)]
    if parent_pid is not None:
        argv += ["--parent-pid", str(parent_pid)]
    return argv


def _await_ready(worker_id: str, proc: subprocess.Popen[str]) -> str:
    """The address a child prints once it serves; RuntimeError if it dies or stays silent."""
    assert proc.stdout is not None
    result: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(_READY_PREFIX):
                result.append(line.split()[-1])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(_START_TIMEOUT_S)
    if not result:
        proc.kill()
        raise RuntimeError(f"worker {worker_id} did not start (exit code {proc.poll()}); "
                           "see its stderr above")
    return result[0]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_disaggregated(config: ClusterConfig, api_key: str | None = None,
                        limits: HttpLimits | None = None) -> int:
    """Run the cluster and the OpenAI API in the foreground until SIGINT/SIGTERM."""
    import uvicorn

    from kvcake.conductor import freeze_heap
    from kvcake.server.frontend.api import create_app
    from kvcake.server.frontend.http_server import listen_socket

    sock = listen_socket(config.host, config.port)
    cluster = Cluster(config)
    # SIGTERM before uvicorn installs its handlers must still tear the children down.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
        assert cluster.backend is not None
        # The long-lived state (Conductor index, app, models) is built: keep the collector off it
        # so that decisions do not pay for full collections over it (conductor/heap.py).
        freeze_heap()
        server = uvicorn.Server(uvicorn.Config(create_app(cluster.backend, api_key=api_key,
                                                          limits=limits),
                                               log_level="warning",
                                               lifespan="off"))
        print(f"kvcake serve: http://{config.host}:{sock.getsockname()[1]} (model "
              f"{config.model}, mode {config.mode}, {len(config.workers)} workers, store master "
              f"{cluster.master_address or '-'})", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
        sock.close()
    return 0
