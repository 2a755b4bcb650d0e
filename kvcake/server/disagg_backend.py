"""The disaggregated backend: the Conductor in the frontend, prefill and decode workers behind it.

Lifecycle of one request (the `Backend` contract of backend.py on the outside):
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

Live view: prefill workers' `KvEvents` and `StoreEvents` feed the Conductor's index (holder
"store" for blocks in the store); the store audit (store_audit.py) removes holder "store" from
blocks the store no longer has; dispatches and completions feed its queue and decode books.
Threads: one reader per worker link and the monitor (monitor.py: pings, store audit); every
shared structure is guarded by `_lock`; tokens reach the HTTP side through
`loop.call_soon_threadsafe`. Nouns elsewhere: disagg_stream.py (flights, streams, totals),
worker_link.py (a worker's link and liveness).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import cast

from kvcake.clock import Clock, SystemClock
from kvcake.conductor import Conductor, ConductorConfig, Placement, Policy, ScheduleRequest
from kvcake.conductor.predictor import DecodeModel, PrefillModel
from kvcake.hashing import block_keys
from kvcake.messages import (
    Abort,
    DecodeAdmitted,
    Hello,
    KvEvents,
    KvReserved,
    LoadReport,
    Message,
    MessageError,
    MessageLink,
    Pong,
    PrefillDone,
    RequestFailed,
    ReserveKv,
    StoreEvents,
    Tokens,
)
from kvcake.server.backend import (
    BackendStats,
    FinishReason,
    GenerateRequest,
    QueueTokenStream,
    Rejected,
    TokenEvent,
)
from kvcake.server.disagg_stream import Flight, Stage, TransferTotals, sampling_of
from kvcake.server.model_front import ModelFront
from kvcake.server.monitor import Monitor, MonitorConfig
from kvcake.server.store_audit import StoreAudit
from kvcake.server.worker_link import WorkerLink, connect_workers
from kvcake.store import StoreClient

__all__ = ["STORE_HOLDER", "DisaggBackend", "Stage", "TransferTotals"]

log = logging.getLogger(__name__)

STORE_HOLDER = "store"


class DisaggBackend(ModelFront):
    """See the module docstring. `start()` connects to the workers; `close()` disconnects."""

    def __init__(self, model: str, worker_addresses: Sequence[str], config: ConductorConfig,
                 prefill_model: PrefillModel, decode_model: DecodeModel,
                 clock: Clock | None = None, *, monitor: MonitorConfig | None = None,
                 store_master: str | None = None, run_monitor: bool = True) -> None:
        """`store_master` (HOST:PORT) turns the store audit on; `run_monitor=False` leaves
        `check_workers()` and `audit_store()` to the caller (tests with a manual clock)."""
        if not worker_addresses:
            raise ValueError("workers: pass at least one worker address")
        super().__init__(model)
        self._addresses = list(worker_addresses)
        self.config = config
        self._prefill_model, self._decode_model = prefill_model, decode_model
        self.clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._workers: dict[str, WorkerLink] = {}
        self._flights: dict[str, Flight] = {}
        self._queued: deque[str] = deque()
        self.conductor: Conductor | None = None
        self.totals = TransferTotals()
        self._layout: Hello | None = None
        self._readers: list[threading.Thread] = []
        self.monitor_config = monitor or MonitorConfig()
        self._store_master, self._run_monitor = store_master, run_monitor
        self._store: StoreClient | None = None
        self.store_audit: StoreAudit | None = None
        self._monitor: Monitor | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> DisaggBackend:
        views = connect_workers(self._addresses)
        self._layout = views[0].hello
        colocated = self.config.policy is Policy.COLOCATED
        prefill_ids = [v.worker_id for v in views if v.hello.role in ("prefill", "colocated")]
        decode_ids = [] if colocated else [v.worker_id for v in views
                                           if v.hello.role == "decode"]
        self.conductor = Conductor(self.config, prefill_ids, decode_ids, self._prefill_model,
                                   self._decode_model, self._layout.kv_bytes_per_token)
        self._workers = {v.worker_id: v for v in views}
        for view in views:
            reader = threading.Thread(target=self._read_loop, args=(view.worker_id, view.link),
                                      name=f"frontend-{view.worker_id}", daemon=True)
            reader.start()
            self._readers.append(reader)
        if self._store_master is not None and self.monitor_config.store_audit_max_keys > 0:
            self._store = StoreClient(self._store_master)
            self.store_audit = StoreAudit(self._layout.namespace,
                                          self.monitor_config.store_audit_max_keys)
        if self._run_monitor:
            self._monitor = Monitor(self.monitor_config, self.check_workers,
                                    self.audit_store if self._store is not None else None)
            self._monitor.start()
        return self

    def close(self, shutdown_workers: bool = False) -> None:
        """Fail what is in flight and disconnect; `shutdown_workers` also asks every worker
        process to exit (`kvcake worker` honours it)."""
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        with self._lock:
            views = list(self._workers.values())
            for flight in list(self._flights.values()):
                self._fail(flight, RuntimeError("the server is shutting down"))
        for view in views:
            view.close(shutdown_worker=shutdown_workers)
        for reader in self._readers:
            reader.join(timeout=5)
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> DisaggBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the Backend contract ------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._hello().max_model_len

    async def generate(self, request: GenerateRequest) -> QueueTokenStream:
        sampling = sampling_of(request)
        layout = self._hello()
        keys = block_keys(request.prompt_token_ids, layout.block_size, layout.namespace)
        schedule = ScheduleRequest(request.request_id, len(request.prompt_token_ids),
                                   tuple(keys), layout.block_size, request.max_tokens)
        sink: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        with self._lock:
            if self.conductor is None:
                raise RuntimeError("DisaggBackend.generate() before start()")
            decision = self.conductor.schedule(schedule, self.clock.now_s())
            if not isinstance(decision, Placement):
                raise Rejected(f"the Conductor rejected the request ({decision.reason.value}: "
                               f"predicted TTFT {decision.predicted_ttft_s:.3f} s, TBT "
                               f"{decision.predicted_tbt_s:.3f} s)", decision.retry_after_s)
            flight = Flight(request, sink, asyncio.get_running_loop(), decision, sampling)
            self._flights[request.request_id] = flight
            self._queued.append(request.request_id)
            self._dispatch_queued()
        return QueueTokenStream(self.abort, request.request_id, sink)

    def stats(self) -> BackendStats:
        with self._lock:
            waiting = sum(f.stage in (Stage.QUEUED, Stage.RESERVING, Stage.PREFILLING)
                          for f in self._flights.values())
            running = sum(f.stage is Stage.DECODING for f in self._flights.values())
            usage = [1 - v.load.num_free_blocks / v.hello.num_blocks
                     for v in self._workers.values() if v.load is not None and v.alive]
            totals = self.totals
            return BackendStats(
                num_waiting_requests=waiting, num_running_requests=running,
                kv_cache_usage=max(usage, default=0.0), transfer_bytes=totals.transfer_bytes,
                extra={"kv_stream_hidden_share": totals.hidden_share,
                       "fetched_tokens": float(totals.num_fetched_tokens),
                       "live_workers": float(sum(v.alive for v in self._workers.values()))})

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its reserved decode blocks are cancelled once the
        prefill acks (nothing writes them any more)."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None or flight.stage is Stage.DONE:
                return
            flight.aborted = True
            placement = flight.placement
            self._send(placement.prefill_id, Abort(request_id))
            if flight.stage is not Stage.PREFILLING:  # nothing may still write its blocks
                if placement.decode_id != placement.prefill_id:
                    flight.reserved = False
                    self._send(placement.decode_id, Abort(request_id))
                self._finish(flight)
            else:
                flight.stage = Stage.DONE
                assert self.conductor is not None
                self.conductor.on_request_aborted(request_id)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        """Stop (or resume) placing new requests on a worker; its running requests finish.
        A resumed prefill worker starts with an empty view of its cache."""
        with self._lock:
            view = self._workers.get(worker_id)
            if view is None or not view.alive:
                raise ValueError(f"worker: no live worker {worker_id!r}")
            assert self.conductor is not None
            known = worker_id in self.conductor.prefill_ids or \
                worker_id in self.conductor.decode_ids
            if draining and known:
                self.conductor.remove_instance(worker_id)
            elif not draining and not known:
                if view.hello.role == "decode":
                    self.conductor.add_decode_instance(worker_id)
                else:
                    self.conductor.add_prefill_instance(worker_id)
                    if self.config.policy is Policy.COLOCATED:
                        self.conductor.add_decode_instance(worker_id)

    def live_worker_ids(self) -> list[str]:
        with self._lock:
            return [w for w, v in self._workers.items() if v.alive]

    # -- housekeeping (the monitor thread, or a test) -----------------------------------------
    def check_workers(self) -> list[str]:
        """Ping the live workers; fail those whose ping is unanswered for worker_timeout_s
        (hung: their link stays open but their engine loop does not turn). Returns them."""
        with self._lock:
            now_s = self.clock.now_s()
            hung = [w for w, v in self._workers.items()
                    if v.alive and v.probe(now_s, self.monitor_config)]
            for worker_id in hung:
                self._on_worker_lost(worker_id, f"did not answer a ping for "
                                                f"{self.monitor_config.worker_timeout_s} s")
        return hung

    def audit_store(self) -> list[int]:
        """One store-audit round (store_audit.py): returns the block keys found gone, which
        the Conductor no longer lists under holder "store"."""
        if self.store_audit is None or self._store is None:
            return []
        assert self.conductor is not None
        conductor = self.conductor
        return self.store_audit.run_round(
            self._store.exists_batch, self._lock,
            lambda gone: conductor.on_blocks_removed(STORE_HOLDER, gone))

    # -- dispatch ------------------------------------------------------------------------------
    def _hello(self) -> Hello:
        if self._layout is None:
            raise RuntimeError("DisaggBackend not started")
        return self._layout

    def _dispatch_queued(self) -> None:
        """Send every queued request on (in arrival order per decode worker); a decode
        worker queues reservations its pool has no room for."""
        blocked: set[str] = set()
        for _ in range(len(self._queued)):
            rid = self._queued.popleft()
            flight = self._flights.get(rid)
            if flight is None or flight.stage is not Stage.QUEUED:
                continue
            decode_id = flight.placement.decode_id
            if decode_id in blocked or not self._try_dispatch(flight):
                blocked.add(decode_id)
                self._queued.append(rid)

    def _try_dispatch(self, flight: Flight) -> bool:
        placement = flight.placement
        request = flight.request
        colocated = placement.decode_id == placement.prefill_id
        decode = self._workers.get(placement.decode_id)
        if decode is None or not decode.alive:
            self._fail(flight, RuntimeError(f"decode worker {placement.decode_id} is gone"))
            return True
        if not colocated:
            flight.stage = Stage.RESERVING
            flight.reserved = True
            # A one-token request ends at the prefill; its reservation (the engine wants
            # max_tokens >= 2) is cancelled once the prefill acks, as an aborted one's.
            sampling = asdict(flight.sampling)
            sampling["max_tokens"] = max(2, sampling["max_tokens"])
            if not self._send(placement.decode_id, ReserveKv(
                    request.request_id, list(request.prompt_token_ids), sampling)):
                self._fail(flight, RuntimeError(f"decode worker {placement.decode_id} is gone"))
            return True
        self._send_prefill(flight)
        return True

    def _on_reserved(self, flight: Flight, reserved: KvReserved) -> None:
        if flight.stage is not Stage.RESERVING:
            return
        num_blocks = -(-len(flight.request.prompt_token_ids) // self._hello().block_size)
        num_cached = num_blocks - len(reserved.block_ids)
        if num_cached < 0:
            self._fail(flight, RuntimeError("decode worker reserved more blocks than the "
                                            "prompt has"))
            return
        flight.targets = [-1] * num_cached + list(reserved.block_ids)
        flight.kv_pool = dict(reserved.kv_pool)
        flight.num_pool_blocks = reserved.num_pool_blocks
        self._send_prefill(flight)

    def _send_prefill(self, flight: Flight) -> None:
        placement = flight.placement
        request = flight.request
        order = flight.prefill_order()
        flight.stage = Stage.PREFILLING
        assert self.conductor is not None
        self.conductor.on_prefill_started(placement.prefill_id, request.request_id,
                                          self.clock.now_s())
        if not self._send(placement.prefill_id, order):
            self._fail(flight, RuntimeError(f"prefill worker {placement.prefill_id} is gone"))

    def _send(self, worker_id: str, message: Message) -> bool:
        view = self._workers.get(worker_id)
        return view is not None and view.send(message)

    # -- events from workers (reader threads) -----------------------------------------------
    def _read_loop(self, worker_id: str, link: MessageLink) -> None:
        while True:
            try:
                message = link.recv()
            except MessageError as exc:
                log.warning("worker %s sent a bad message: %s", worker_id, exc)
                message = None
            if message is None:
                self._on_worker_lost(worker_id)
                return
            with self._lock:
                self._on_message(worker_id, message)

    def _on_message(self, worker_id: str, message: Message) -> None:
        conductor = self.conductor
        assert conductor is not None
        if isinstance(message, KvEvents):
            if worker_id in conductor.prefill_ids:
                conductor.on_blocks_stored(worker_id, message.stored)
                conductor.on_blocks_removed(worker_id, message.removed)
            return
        if isinstance(message, StoreEvents):
            conductor.on_blocks_stored(STORE_HOLDER, message.stored)
            if self.store_audit is not None:
                conductor.on_blocks_removed(STORE_HOLDER, self.store_audit.track(message.stored))
            return
        if isinstance(message, LoadReport):
            self._workers[worker_id].load = message
            return
        if isinstance(message, Pong):
            self._workers[worker_id].on_pong(message.seq)
            return
        flight = self._flights.get(getattr(message, "request_id", ""))
        if flight is None:
            return
        if isinstance(message, PrefillDone):
            self._on_prefill_done(flight, message)
        elif isinstance(message, KvReserved):
            self._on_reserved(flight, message)
        elif isinstance(message, DecodeAdmitted):
            flight.reserved = False  # the decode engine owns the blocks now
            conductor.on_decode_joined(flight.placement.decode_id, message.request_id,
                                       self.clock.now_s())
            self._dispatch_queued()
        elif isinstance(message, Tokens):
            reason = FinishReason(message.finish_reason) if message.finish_reason else None
            flight.emit(TokenEvent(tuple(message.token_ids), flight.num_cached_tokens,
                                          reason))
            if reason is not None:
                self._finish(flight)
        elif isinstance(message, RequestFailed):
            if flight.aborted:
                self._finish(flight)
            else:
                self._fail(flight, RuntimeError(f"worker {worker_id}: {message.message}"))

    def _on_prefill_done(self, flight: Flight, done: PrefillDone) -> None:
        conductor = self.conductor
        assert conductor is not None
        placement = flight.placement
        now_s = self.clock.now_s()
        conductor.on_prefill_finished(placement.prefill_id, done.request_id, now_s)
        conductor.on_transfer_done(done.request_id, now_s)
        self.totals.add(done)
        fetch = placement.fetch
        if fetch is not None and self.store_audit is not None and \
                done.num_fetched_tokens < len(fetch.keys) * self._hello().block_size:
            # A short fetch: some planned blocks may have left the store; check them first.
            self.store_audit.suspect([cast(int, k) for k in fetch.keys])
        if flight.aborted:
            self._finish(flight)
            return
        flight.num_cached_tokens = done.num_cached_tokens
        reason = FinishReason(done.finish_reason) if done.finish_reason else None
        flight.emit(TokenEvent((done.first_token_id,), done.num_cached_tokens, reason))
        if reason is not None:
            self._finish(flight)
            return
        flight.stage = Stage.DECODING
        if placement.decode_id == placement.prefill_id:  # colocated: it decodes in place
            conductor.on_decode_joined(placement.decode_id, done.request_id, now_s)
            return
        if not self._send(placement.decode_id, flight.decode_order(done.first_token_id,
                                                                  done.sampler_state)):
            self._fail(flight, RuntimeError(f"decode worker {placement.decode_id} is gone"))

    def _on_worker_lost(self, worker_id: str, why: str = "its link closed") -> None:
        with self._lock:
            view = self._workers.get(worker_id)
            if view is None or not view.alive:
                return
            view.alive = False
            view.link.close()  # a hung worker's late messages are not read any more
            log.warning("worker %s lost (%s); its requests fail, new ones go to the others",
                        worker_id, why)
            assert self.conductor is not None
            self.conductor.remove_instance(worker_id)
            for flight in list(self._flights.values()):
                p = flight.placement
                if worker_id not in (p.prefill_id, p.decode_id):
                    continue
                if worker_id == p.prefill_id and flight.stage is Stage.PREFILLING:
                    # A lost prefill worker may be hung rather than dead, and might still write
                    # into the blocks reserved on d: never hand them back (a bounded leak on d
                    # per lost worker is the price of never serving overwritten KV).
                    flight.reserved = False
                if flight.aborted:  # nothing will ack the abort now
                    self._finish(flight)
                    continue
                role = "decode" if worker_id == p.decode_id else "prefill"
                self._fail(flight, RuntimeError(
                    f"{role} worker {worker_id} failed while serving this request; retry it"))
            self._dispatch_queued()

    # -- endings -------------------------------------------------------------------------------
    def _fail(self, flight: Flight, error: BaseException) -> None:
        if flight.stage is not Stage.DONE and not flight.aborted:
            flight.emit(error)
        placement = flight.placement
        for worker_id in {placement.prefill_id, placement.decode_id}:
            self._send(worker_id, Abort(flight.request.request_id))
        self._finish(flight)

    def _finish(self, flight: Flight) -> None:
        rid = flight.request.request_id
        flight.stage = Stage.DONE
        self._cancel_reservation(flight)
        self._flights.pop(rid, None)
        assert self.conductor is not None
        self.conductor.on_request_aborted(rid)  # forgets whatever is still booked
        self._dispatch_queued()

    def _cancel_reservation(self, flight: Flight) -> None:
        """Called once nothing writes the reserved blocks any more."""
        if flight.reserved:
            flight.reserved = False
            self._send(flight.placement.decode_id, Abort(flight.request.request_id))

