"""The requests in flight of the disaggregated backend and the orders that move them on.

Life of one flight (its `Stage`, flight.py), p its prefill and d its decode worker:
  QUEUED      placed by the Conductor, not yet sent anywhere (it leaves this stage at once:
              d itself queues reservations its pool has no room for).
  RESERVING   `ReserveKv` to d, whose engine reserves the KV blocks (waiting while its pool is
              full) -> `KvReserved` names them.                  (colocated, p == d: skipped)
  PREFILLING  `PrefillOrder` to p, which writes the KV straight into those blocks of d's pool;
              `PrefillStarted`: p's engine began it (the Conductor's queue of p runs it down).
  DECODING    `PrefillDone`: the first token goes to the client (TTFT), `DecodeOrder` to d
              (colocated: p decodes in place); `DecodeAdmitted`: d committed the reservation;
              `Tokens` stream to the client until one carries a finish reason.
  DONE        finished, failed or aborted; the Conductor forgets it.
A reservation on d is cancelled (`Abort` to d) only once nothing writes its blocks: an aborted
request's once p acked; a request whose prefill worker was lost while it might still write
(its order out, no answer yet) never: d gets `Abort(keep_reserved=True)` and keeps the blocks
out of use (p may be hung, not dead) until p is known dead, its process reaped
(`on_worker_dead`: a plain `Abort` to d frees them): never serving overwritten KV.

A CPP placement (`Placement.prefill_group`, stages in pipeline order) is one prefill to this
book: `CppOrder` to every stage instead of `PrefillOrder`, and the request moves on (first token,
`DecodeOrder`) once every stage has answered `PrefillDone` (each after its own KV writes; the
last stage's carries the token); a stage that fails or is lost fails the request, and the
reservation waits until no stage writes (as for a single prefill worker).

Not thread-safe: the backend calls every method under its lock. Events reach the HTTP side
through `Flight.emit` (any thread).
"""

from __future__ import annotations

from dataclasses import asdict, replace

from kvcake.clock import Clock
from kvcake.server.cluster.flight import Flight, Stage, TransferTotals
from kvcake.server.cluster.router import Router
from kvcake.server.cluster.worker_set import WorkerSet
from kvcake.server.frontend.backend import (
    FinishReason,
    TokenEvent,
    logprobs_of,
    prompt_logprobs_of,
)
from kvcake.server.worker.messages import (
    Abort,
    DecodeAdmitted,
    KvReserved,
    Message,
    PrefillDone,
    PrefillStarted,
    RequestFailed,
    ReserveKv,
    Tokens,
)

__all__ = ["Flights"]


class Flights:
    def __init__(self, workers: WorkerSet, router: Router, clock: Clock,
                 totals: TransferTotals) -> None:
        self._workers, self._router, self._clock = workers, router, clock
        self.totals = totals  # summed over every PrefillDone
        self.by_id: dict[str, Flight] = {}
        # lost prefill worker -> [(decode worker, request id)] whose reservations d keeps out
        # of use until that worker is known dead (`on_worker_dead`)
        self.kept: dict[str, list[tuple[str, str]]] = {}

    def admit(self, flight: Flight) -> None:
        """A placed request: send its first order (`ReserveKv` to d, or colocated the
        `PrefillOrder` to p)."""
        self.by_id[flight.request.request_id] = flight
        self._dispatch(flight)

    def counts(self) -> tuple[int, int]:
        """(waiting for their first token, decoding)."""
        flights = self.by_id.values()
        waiting = sum(f.stage in (Stage.QUEUED, Stage.RESERVING, Stage.PREFILLING)
                      for f in flights)
        return waiting, sum(f.stage is Stage.DECODING for f in flights)

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its reserved decode blocks are cancelled once the
        prefill acks (nothing writes them any more)."""
        flight = self.by_id.get(request_id)
        if flight is None or flight.stage is Stage.DONE:
            return
        flight.aborted = True
        placement = flight.placement
        for prefill_id in flight.prefill_ids:
            self._workers.send(prefill_id, Abort(request_id))
        if flight.stage is not Stage.PREFILLING:  # nothing may still write its blocks
            if placement.decode_id != placement.prefill_id:
                flight.reserved = False
                self._workers.send(placement.decode_id, Abort(request_id))
            self._finish(flight)
        else:
            flight.stage = Stage.DONE
            self._router.request_ended(request_id)

    def fail_all(self, why: str) -> None:
        """End every flight with a RuntimeError(why) (the server is shutting down)."""
        for flight in list(self.by_id.values()):
            self._fail(flight, RuntimeError(why))

    # -- events from workers -------------------------------------------------------------------
    def on_message(self, worker_id: str, message: Message) -> None:
        """A worker's message about one request; one about no live flight is dropped."""
        flight = self.by_id.get(getattr(message, "request_id", ""))
        if flight is None:
            return
        if isinstance(message, PrefillStarted):
            if flight.stage is Stage.PREFILLING and not flight.placement.prefill_group:
                self._router.prefill_started(flight.placement, message.request_id,
                                             self._clock.now_s())
        elif isinstance(message, PrefillDone):
            if flight.placement.prefill_group:
                self._on_stage_done(flight, worker_id, message)
            else:
                self._on_prefill_done(flight, message)
        elif isinstance(message, KvReserved):
            self._on_reserved(flight, message)
        elif isinstance(message, DecodeAdmitted):
            flight.reserved = False  # the decode engine owns the blocks now
            self._router.decode_joined(flight.placement, message.request_id,
                                       self._clock.now_s())
        elif isinstance(message, Tokens):
            reason = FinishReason(message.finish_reason) if message.finish_reason else None
            flight.emit(TokenEvent(tuple(message.token_ids), flight.num_cached_tokens, reason,
                                   logprobs_of(message.logprobs)))
            if reason is not None:
                self._finish(flight)
        elif isinstance(message, RequestFailed):
            if flight.placement.prefill_group:
                self._on_stage_failed(flight, worker_id, message)
                return
            if worker_id == flight.placement.prefill_id:
                flight.prefill_writing = False
            if flight.aborted:
                self._finish(flight)
            else:
                self._fail(flight, RuntimeError(f"worker {worker_id}: {message.message}"))

    def on_worker_lost(self, worker_id: str) -> None:
        """End the flights placed on a lost worker."""
        for flight in list(self.by_id.values()):
            p = flight.placement
            if worker_id not in (*flight.prefill_ids, p.decode_id):
                continue
            if worker_id in flight.prefill_ids and flight.prefill_writing and flight.reserved:
                # p may be hung rather than dead and still write into the blocks reserved on
                # d: never hand them back (see the module docstring)
                flight.reserved = False
                flight.kv_kept = True
                self.kept.setdefault(worker_id, []).append((p.decode_id,
                                                            flight.request.request_id))
            if flight.aborted:  # nothing will ack the abort now
                if flight.kv_kept:
                    self._workers.send(p.decode_id, Abort(flight.request.request_id,
                                                          keep_reserved=True))
                self._finish(flight)
                continue
            role = "decode" if worker_id == p.decode_id else "prefill"
            self._fail(flight, RuntimeError(
                f"{role} worker {worker_id} failed while serving this request; retry it"))

    def on_worker_dead(self, worker_id: str) -> int:
        """The lost worker's process is reaped: nothing it ran can write any more, so the
        reservations kept for its prefills go back to their decode workers (a plain `Abort`).
        Returns how many were released."""
        released = 0
        for decode_id, request_id in self.kept.pop(worker_id, []):
            if self._workers.send(decode_id, Abort(request_id)):
                released += 1
        return released

    # -- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, flight: Flight) -> None:
        placement = flight.placement
        request = flight.request
        if not self._workers.is_live(placement.decode_id):
            self._fail(flight, RuntimeError(f"decode worker {placement.decode_id} is gone"))
            return
        if placement.decode_id != placement.prefill_id:
            flight.stage = Stage.RESERVING
            flight.reserved = True
            # A one-token request ends at the prefill; its reservation (the engine wants
            # max_tokens >= 2) is cancelled once the prefill acks, as an aborted one's.
            sampling = asdict(flight.sampling)
            sampling["max_tokens"] = max(2, sampling["max_tokens"])
            if not self._workers.send(placement.decode_id, ReserveKv(
                    request.request_id, list(request.prompt_token_ids), sampling)):
                self._fail(flight, RuntimeError(f"decode worker {placement.decode_id} is gone"))
            return
        self._send_prefill(flight)

    def _on_reserved(self, flight: Flight, reserved: KvReserved) -> None:
        if flight.stage is not Stage.RESERVING:
            return
        num_blocks = -(-len(flight.request.prompt_token_ids) // self._router.block_size)
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
        flight.stage = Stage.PREFILLING
        flight.prefill_writing = True
        if placement.prefill_group:  # its stages start together: the group's clock runs now
            self._router.prefill_started(placement, flight.request.request_id,
                                         self._clock.now_s())
            self._send_cpp(flight)
            return
        if not self._workers.send(placement.prefill_id,
                                  flight.prefill_order(self._router.store_layer_bounds())):
            self._fail(flight, RuntimeError(f"prefill worker {placement.prefill_id} is gone"))

    def _send_cpp(self, flight: Flight) -> None:
        """`CppOrder` to every stage of the group, each told the next stage's inbox."""
        group = flight.placement.prefill_group
        inboxes: list[dict[str, object]] = []
        for stage_id in group[1:]:
            view = self._workers.get(stage_id)
            inbox = view.hello.cpp_inbox if view is not None and view.alive else None
            if not inbox:
                self._fail(flight, RuntimeError(f"cpp stage {stage_id} is gone"))
                return
            inboxes.append(inbox)
        flight.cpp_waiting = set(group)
        for i, (stage_id, inbox) in enumerate(zip(group, [*inboxes, {}], strict=True)):
            if not self._workers.send(stage_id, flight.cpp_order(dict(inbox))):
                if i > 0 and flight.reserved:  # stages before it may write: keep the blocks
                    flight.reserved, flight.kv_kept = False, True
                    self.kept.setdefault(stage_id, []).append((flight.placement.decode_id,
                                                               flight.request.request_id))
                self._fail(flight, RuntimeError(f"cpp stage {stage_id} is gone"))
                return

    def _on_stage_done(self, flight: Flight, worker_id: str, done: PrefillDone) -> None:
        """One stage's KV is written; the last stage's report carries the first token. Once
        every stage is done the request goes on as after a single prefill."""
        if worker_id not in flight.cpp_waiting:
            return
        flight.cpp_waiting.discard(worker_id)
        flight.cpp_transfer_bytes += done.transfer_bytes
        if worker_id == flight.placement.prefill_group[-1]:
            flight.cpp_done = done
        if flight.cpp_waiting:
            return
        if flight.cpp_done is None:  # cannot happen: the last stage answered above
            self._fail(flight, RuntimeError("the CPP group sent no first token"))
            return
        self._on_prefill_done(flight, replace(flight.cpp_done,
                                              transfer_bytes=flight.cpp_transfer_bytes))

    def _on_stage_failed(self, flight: Flight, worker_id: str, failed: RequestFailed) -> None:
        """A stage refused or gave up (or acked an abort): the others are stopped, and the
        reservation is cancelled once no stage can write it any more."""
        flight.cpp_waiting.discard(worker_id)
        flight.prefill_writing = bool(flight.cpp_waiting)
        if not flight.aborted:
            flight.emit(RuntimeError(f"worker {worker_id}: {failed.message}"))
            self.abort(flight.request.request_id)
        if not flight.cpp_waiting:
            self._finish(flight)

    def _on_prefill_done(self, flight: Flight, done: PrefillDone) -> None:
        placement = flight.placement
        now_s = self._clock.now_s()
        flight.prefill_writing = False
        self._router.prefill_done(placement, done, now_s)
        self.totals.add(done)
        if flight.aborted:
            self._finish(flight)
            return
        flight.num_cached_tokens = done.num_cached_tokens
        reason = FinishReason(done.finish_reason) if done.finish_reason else None
        flight.emit(TokenEvent((done.first_token_id,), done.num_cached_tokens, reason,
                               logprobs_of(done.logprobs),
                               prompt_logprobs_of(done.prompt_logprobs)))
        if reason is not None:
            self._finish(flight)
            return
        flight.stage = Stage.DECODING
        if placement.decode_id == placement.prefill_id:  # colocated: it decodes in place
            self._router.decode_joined(placement, done.request_id, now_s)
            return
        if not self._workers.send(placement.decode_id,
                                  flight.decode_order(done.first_token_id, done.sampler_state)):
            self._fail(flight, RuntimeError(f"decode worker {placement.decode_id} is gone"))

    # -- endings -------------------------------------------------------------------------------
    def _fail(self, flight: Flight, error: BaseException) -> None:
        if flight.stage is not Stage.DONE and not flight.aborted:
            flight.emit(error)
        placement = flight.placement
        for worker_id in {*flight.prefill_ids, placement.decode_id}:
            keep = flight.kv_kept and worker_id == placement.decode_id
            self._workers.send(worker_id, Abort(flight.request.request_id, keep_reserved=keep))
        self._finish(flight)

    def _finish(self, flight: Flight) -> None:
        rid = flight.request.request_id
        flight.stage = Stage.DONE
        self._cancel_reservation(flight)
        self.by_id.pop(rid, None)
        self._router.request_ended(rid)  # forgets whatever is still booked

    def _cancel_reservation(self, flight: Flight) -> None:
        """Called once nothing writes the reserved blocks any more."""
        if flight.reserved:
            flight.reserved = False
            self._workers.send(flight.placement.decode_id, Abort(flight.request.request_id))
