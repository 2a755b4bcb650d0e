"""The disaggregated backend: the Conductor in the frontend, prefill and decode workers behind it.

Lifecycle of one request (the `Backend` contract of frontend/backend.py on the outside):
  generate()   block keys of the prompt (the workers' namespace and block size) ->
               `Conductor.schedule` with the live view -> Rejection: `Rejected` (HTTP 429) |
               Placement (p, d, fetch plan): `ReserveKv` to d (d's engine reserves the KV
               blocks, waiting while its pool is full) -> `KvReserved` -> `PrefillOrder` to p,
               which writes the KV straight into those blocks of d's pool;
  PrefillDone  first token to the client (TTFT), `DecodeOrder` to d (colocated: p decodes);
  DecodeAdmitted  d committed the reservation;  Tokens  stream to the client.
  An aborted request's reservation is cancelled (`Abort` to d) only once p acked, so nothing
  writes blocks d may hand out again.
  A worker whose link drops, or that leaves a ping unanswered for `worker_timeout_s` (a hung
  engine loop), is removed from the Conductor; its requests end with an error event, later
  requests go to the survivors.

This module wires the nouns and owns the one lock: router.py (admission, the
Conductor's live view: prefill workers' `KvEvents`, `StoreEvents` under holder "store",
membership), flights.py (the requests in flight and the orders that move them),
worker_set.py (the links, reader threads and liveness), flight.py (a `Flight`,
`TransferTotals`), store_audit.py (holder "store" kept true), monitor.py (paces
`check_workers()` and `audit_store()`).
Threads: one reader per worker link and the monitor; every shared structure is guarded by
`_lock` (the parts are not thread-safe); tokens reach the HTTP side through
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from prometheus_client.registry import Collector

from kvcake.auth import ClusterSecret
from kvcake.clock import Clock, SystemClock
from kvcake.conductor import Conductor, ConductorConfig, Placement, ScheduleRequest
from kvcake.conductor.predictor import DecodeModel, PrefillModel
from kvcake.server.cluster.flight import Flight, Stage, TransferTotals, sampling_of
from kvcake.server.cluster.flights import Flights
from kvcake.server.cluster.monitor import Monitor, MonitorConfig
from kvcake.server.cluster.placement_trace import PlacementTrace
from kvcake.server.cluster.router import STORE_HOLDER, Router, schedule_request
from kvcake.server.cluster.store_audit import StoreAudit
from kvcake.server.cluster.worker_link import connect_workers
from kvcake.server.cluster.worker_set import WorkerSet
from kvcake.server.frontend.backend import (
    BackendStats,
    GenerateRequest,
    QueueTokenStream,
    Rejected,
    TokenEvent,
)
from kvcake.server.frontend.model_front import ModelFront
from kvcake.server.worker.messages import (
    NEXT_STAGE_NEW,
    CppHidden,
    CppSlotFree,
    Hello,
    KvEvents,
    Message,
    StoreEvents,
)
from kvcake.store import StoreClient
from kvcake.transfer import TransferConfig

__all__ = ["STORE_HOLDER", "DisaggBackend", "DisaggConfig", "Stage", "TransferTotals"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DisaggConfig:
    """What the disaggregated backend serves and how it watches its workers."""

    model: str  # preset name or Hugging Face directory (config and tokenizer only)
    worker_addresses: tuple[str, ...]  # HOST:PORT of each worker's control link (list: taken)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    store_master: str | None = None  # HOST:PORT or etcd://...: turns the store audit on
    # False leaves `check_workers()` and `audit_store()` to the caller (tests, manual clock).
    run_monitor: bool = True
    # Workers join (and leave) while serving, through `add_worker` (etcd membership:
    # cluster/membership.py); `worker_addresses` may then be empty.
    workers_join: bool = False
    # The cluster secret (`kvcake.auth`) proved to every worker's control port and the store
    # master; None: the workers and the master run without one.
    secret: ClusterSecret | None = field(default=None, repr=False)
    # Admission before the Conductor: 429 while this many requests wait for their first token.
    max_waiting_requests: int | None = None
    served_model_names: tuple[str, ...] = ()  # (): the model's own name

    def __post_init__(self) -> None:
        if isinstance(self.worker_addresses, str):
            raise ValueError(f"worker_addresses: pass a list of HOST:PORT strings, not the "
                             f"single string {self.worker_addresses!r}")
        if not self.worker_addresses and not self.workers_join:
            raise ValueError("worker_addresses: pass at least one worker address (HOST:PORT)")
        object.__setattr__(self, "worker_addresses", tuple(self.worker_addresses))


class DisaggBackend(ModelFront):
    """See the module docstring. `start()` connects to the workers; `close()` disconnects."""

    def __init__(self, config: DisaggConfig, prefill_model: PrefillModel,
                 decode_model: DecodeModel, clock: Clock | None = None) -> None:
        super().__init__(config.model, config.served_model_names)
        self.config = config
        self._prefill_model, self._decode_model = prefill_model, decode_model
        self.clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._workers = WorkerSet()
        self.totals = TransferTotals()
        self._layout: Hello | None = None
        self._router: Router | None = None
        self._book: Flights | None = None
        self._store: StoreClient | None = None
        self._monitor: Monitor | None = None
        self.collectors: list[Collector] = []  # more metrics for the frontend's /metrics
        self._placements: PlacementTrace | None = None  # $KVCAKE_PLACEMENT_TRACE

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> DisaggBackend:
        """Connect to the workers and start reading them; on any failure, everything opened so
        far is closed again before the error propagates."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> DisaggBackend:
        cfg = self.config
        self._placements = PlacementTrace.from_env()
        if cfg.worker_addresses:  # else the first worker that joins gives the layout
            self._init_router(self._workers.connect(cfg.worker_addresses,
                                                    cfg.monitor.worker_timeout_s, cfg.secret))
        self._workers.start_readers(self._on_message, self._on_worker_lost)
        if cfg.run_monitor:
            self._monitor = Monitor(cfg.monitor, self.check_workers,
                                    self.audit_store if self._store is not None else None)
            self._monitor.start()
        return self

    def _init_router(self, hellos: list[Hello]) -> None:
        """The Conductor over the first workers; their layout is the cluster's from now on."""
        cfg = self.config
        self._layout = hellos[0]
        for hello in hellos:
            log.info("worker %s (%s) joined", hello.worker_id, hello.role)
        audit: StoreAudit | None = None  # made before the readers start: it sees every StoreEvents
        if cfg.store_master is not None and cfg.monitor.store_audit_max_keys > 0:
            self._store = StoreClient(cfg.store_master, transfer_config=TransferConfig(
                serve=False, secret=cfg.secret))
            audit = StoreAudit(self._layout.namespace, cfg.monitor.store_audit_max_keys)
        self._router = Router.for_workers(cfg.conductor, hellos, self._prefill_model,
                                          self._decode_model, audit)
        self._book = Flights(self._workers, self._router, self.clock, self.totals)

    def add_worker(self, address: str) -> Hello:
        """Connect to a worker that joined (etcd membership) and place requests on it from now
        on; a restarted worker rejoins under its old id. ValueError naming the worker when it
        cannot be reached at `address` or its KV layout is not the cluster's."""
        try:
            view = connect_workers([address], self.config.monitor.worker_timeout_s,
                                   self.config.secret)[0]
        except OSError as exc:
            raise ValueError(f"worker at {address}: cannot connect ({exc}); is its "
                             "--advertise-host an address this frontend can reach?") from None
        hello = view.hello
        with self._lock:
            try:
                layout = self._layout
                if layout is not None and (hello.namespace, hello.block_size) != \
                        (layout.namespace, layout.block_size):
                    raise ValueError(f"worker {hello.worker_id} at {address}: KV namespace "
                                     f"{hello.namespace!r} differs from the cluster's "
                                     f"{layout.namespace!r}; run it with the same model, dtype, "
                                     "seed and block size")
                if self._router is None:
                    self._init_router([hello])
                else:
                    self._router.set_draining(hello.worker_id, hello.role, False,
                                              hello.cpp_member)
                self._workers.add(view)
                if hello.role == "cpp":  # the stage before may still count slots of the old one
                    self._relay_cpp(hello.worker_id, CppSlotFree("", NEXT_STAGE_NEW))
            except BaseException:
                view.link.close()
                raise
        log.info("worker %s (%s) joined at %s", hello.worker_id, hello.role, address)
        return hello

    def worker_left(self, worker_id: str) -> None:
        """Membership says the worker is gone (its etcd lease ended): as if its link closed."""
        self._on_worker_lost(worker_id, "its etcd registration ended")

    def close(self, shutdown_workers: bool = False) -> None:
        """Fail what is in flight and disconnect; `shutdown_workers` also asks every worker
        process to exit (`kvcake worker` honours it)."""
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        with self._lock:
            if self._book is not None:
                self._book.fail_all("the server is shutting down")
        self._workers.close(shutdown_workers)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._placements is not None:
            self._placements.close()
            self._placements = None

    def __enter__(self) -> DisaggBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- views (None before start) -------------------------------------------------------------
    @property
    def conductor(self) -> Conductor | None:
        return self._router.conductor if self._router is not None else None

    @property
    def store_audit(self) -> StoreAudit | None:
        return self._router.store_audit if self._router is not None else None

    @property
    def _flights(self) -> dict[str, Flight]:
        """The requests in flight by id (read by tests; mutate only through `Flights`)."""
        return self._book.by_id if self._book is not None else {}

    # -- the Backend contract ------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        if self._layout is None and self.config.workers_join:  # no worker has joined yet
            return int(self._model_config.max_position_embeddings)
        return self._hello().max_model_len

    async def generate(self, request: GenerateRequest) -> QueueTokenStream:
        sampling = sampling_of(request)
        if self._layout is None and self.config.workers_join:
            raise Rejected("no worker has joined the cluster yet: start `kvcake worker --etcd "
                           "...` on a host", 1.0, "no_worker")
        schedule = schedule_request(request, self._hello())
        sink: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        with self._lock:
            if self._router is None or self._book is None:
                raise RuntimeError("DisaggBackend.generate() before start()")
            limit = self.config.max_waiting_requests
            if limit is not None and self._book.counts()[0] >= limit:
                raise Rejected(f"{limit} requests are waiting for their first token (limit "
                               f"{limit}); retry later", self.config.conductor.min_retry_after_s,
                               "max_waiting_requests")
            placement = self._place(schedule)
            self._book.admit(Flight(request, sink, asyncio.get_running_loop(), placement,
                                    sampling))
        return QueueTokenStream(self.abort, request.request_id, sink)

    def _place(self, schedule: ScheduleRequest) -> Placement:
        """The Conductor's placement (`Rejected`: HTTP 429), written to the placement trace
        when one is on. Under the lock."""
        assert self._router is not None
        now_s = self.clock.now_s()
        try:
            placement = self._router.place(schedule, now_s)
        except Rejected as rejection:
            if self._placements is not None:
                self._placements.rejected(now_s, schedule, rejection)
            raise
        if self._placements is not None:
            self._placements.placed(now_s, schedule, placement)
        return placement

    def stats(self) -> BackendStats:
        with self._lock:
            waiting, running = self._book.counts() if self._book is not None else (0, 0)
            totals = self.totals
            return BackendStats(
                num_waiting_requests=waiting, num_running_requests=running,
                kv_cache_usage=self._workers.kv_cache_usage(),
                transfer_bytes=totals.transfer_bytes,
                extra={"kv_stream_hidden_share": totals.hidden_share,
                       "fetched_tokens": float(totals.num_fetched_tokens),
                       "live_workers": float(len(self._workers.live_ids())),
                       **self._live_by_role()})

    def _live_by_role(self) -> dict[str, float]:
        """live_<role>_workers for every role that has a live worker (/metrics by role)."""
        counts: dict[str, float] = {}
        for worker_id in self._workers.live_ids():
            view = self._workers.get(worker_id)
            if view is not None:
                key = f"live_{view.hello.role}_workers"
                counts[key] = counts.get(key, 0.0) + 1
        return counts

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its reserved decode blocks are cancelled once the
        prefill acks (nothing writes them any more)."""
        with self._lock:
            if self._book is not None:
                self._book.abort(request_id)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        """Stop (or resume) placing new requests on a worker; its running requests finish.
        A resumed prefill worker starts with an empty view of its cache."""
        with self._lock:
            view = self._workers.get(worker_id)
            if view is None or not view.alive:
                raise ValueError(f"worker: no live worker {worker_id!r}")
            assert self._router is not None
            self._router.set_draining(worker_id, view.hello.role, draining,
                                      view.hello.cpp_member)

    def live_worker_ids(self) -> list[str]:
        with self._lock:
            return self._workers.live_ids()

    # -- housekeeping (the monitor thread, or a test) -----------------------------------------
    def check_workers(self) -> list[str]:
        """Ping the live workers; fail those whose ping is unanswered for worker_timeout_s
        (hung: their link stays open but their engine loop does not turn). Returns them."""
        timeout_s = self.config.monitor.worker_timeout_s
        with self._lock:
            hung = self._workers.hung(self.clock.now_s(), self.config.monitor)
            for worker_id in hung:
                self._on_worker_lost(worker_id, f"did not answer a ping for {timeout_s} s")
        return hung

    def audit_store(self) -> list[int]:
        """One store-audit round (store_audit.py): returns the block keys found gone, which
        the Conductor no longer lists under holder "store"."""
        router = self._router
        if router is None or router.store_audit is None or self._store is None:
            return []
        return router.store_audit.run_round(self._store.exists_batch, self._lock,
                                            router.on_store_gone)

    # -- events from workers (reader threads) -----------------------------------------------
    def _hello(self) -> Hello:
        if self._layout is None:
            raise RuntimeError("DisaggBackend not started")
        return self._layout

    def _on_message(self, worker_id: str, message: Message) -> None:
        with self._lock:
            assert self._router is not None and self._book is not None
            if isinstance(message, KvEvents):
                self._router.on_kv_events(worker_id, message)
            elif isinstance(message, StoreEvents):
                self._router.on_store_events(message)
            elif isinstance(message, CppHidden | CppSlotFree):
                self._relay_cpp(worker_id, message)
            elif not self._workers.on_report(worker_id, message):
                self._book.on_message(worker_id, message)

    def _relay_cpp(self, worker_id: str, message: CppHidden | CppSlotFree) -> None:
        """Hidden states go down the pipeline (stage s -> s+1), freed inbox slots up (s+1 ->
        s); relayed whether or not the request still lives, so no slot is ever lost."""
        view = self._workers.get(worker_id)
        stage = view.hello.cpp_member if view is not None else None
        if stage is None:
            return
        to = stage + 1 if isinstance(message, CppHidden) else stage - 1
        for other in self._workers.live_ids():
            peer = self._workers.get(other)
            if peer is not None and peer.hello.role == "cpp" and peer.hello.cpp_member == to:
                self._workers.send(other, message)
                return

    def worker_dead(self, worker_id: str, why: str = "its process exited") -> int:
        """The worker's process is known dead (reaped by whoever launched it): lost if it was
        not already, and the decode blocks kept out of use for its prefills are freed (it can
        no longer write them). Returns how many reservations were freed."""
        self._on_worker_lost(worker_id, why)
        with self._lock:
            if self._book is None:
                return 0
            released = self._book.on_worker_dead(worker_id)
        if released:
            log.info("worker %s is dead: %d kept KV reservations freed", worker_id, released)
        return released

    def _on_worker_lost(self, worker_id: str, why: str = "its link closed") -> None:
        with self._lock:
            if not self._workers.mark_lost(worker_id):
                return
            log.warning("worker %s lost (%s); its requests fail, new ones go to the others",
                        worker_id, why)
            assert self._router is not None and self._book is not None
            self._router.remove(worker_id)
            self._book.on_worker_lost(worker_id)
