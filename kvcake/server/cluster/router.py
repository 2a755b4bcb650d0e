"""Routing and admission through the Conductor: the frontend's only door to it.

The disaggregated backend asks `place()` where a request goes (a `Placement`, or `Rejected`:
HTTP 429) and reports each step of the request's life here, so the Conductor's queue and decode
books follow the cluster. Workers' events keep its index true: a prefill worker's `KvEvents`
under its own id, `StoreEvents` under holder `STORE_HOLDER` (tracked by the store audit, which
later reports blocks the store lost: `on_store_gone`). Membership: `set_draining` takes a worker
out of (or back into) placement; `remove` forgets a lost one.

Policy glue only: no threads, sockets or clock reads (times are passed in). Not thread-safe:
the backend calls every method under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from kvcake.conductor import (
    Admission,
    Conductor,
    ConductorConfig,
    Placement,
    Policy,
    ScheduleRequest,
)
from kvcake.conductor.predictor import DecodeModel, PrefillModel
from kvcake.hashing import block_keys
from kvcake.server.cluster.stage_stores import StageStores
from kvcake.server.cluster.store_audit import StoreAudit
from kvcake.server.frontend.backend import GenerateRequest, Rejected
from kvcake.server.worker.messages import Hello, KvEvents, PrefillDone, StoreEvents

__all__ = ["STORE_HOLDER", "Router", "schedule_request"]

STORE_HOLDER = "store"


def schedule_request(request: GenerateRequest, layout: Hello) -> ScheduleRequest:
    """What the Conductor sees of a request: its length and the block keys of its prompt in the
    workers' namespace and block size. Hashing is the costly part: call it outside the lock."""
    keys = block_keys(request.prompt_token_ids, layout.block_size, layout.namespace)
    return ScheduleRequest(request.request_id, len(request.prompt_token_ids), tuple(keys),
                           layout.block_size, request.max_tokens)


class Router:
    def __init__(self, conductor: Conductor, block_size: int,
                 store_audit: StoreAudit | None = None, num_layers: int | None = None) -> None:
        self.conductor = conductor
        self.block_size = block_size
        self.store_audit = store_audit
        # CPP stages' layer slices, listed once a block's are all in (None: no layer count)
        self.stage_stores = StageStores(num_layers) if num_layers else None

    @classmethod
    def for_workers(cls, config: ConductorConfig, workers: Sequence[Hello],
                    prefill_model: PrefillModel, decode_model: DecodeModel,
                    store_audit: StoreAudit | None = None) -> Router:
        """A Conductor over `workers` by role (colocated policy: every worker prefills and
        decodes); the first worker's `Hello` gives the KV layout, the smallest decode worker's
        KV pool the decode capacity early rejection forecasts against (unless configured)."""
        layout = workers[0]
        prefill_ids = [h.worker_id for h in workers if h.role in ("prefill", "colocated")]
        decode_ids = [] if config.policy is Policy.COLOCATED else \
            [h.worker_id for h in workers if h.role == "decode"]
        if config.admission is Admission.DECODE_AFTER_PREFILL:
            raise ValueError("conductor admission decode_after_prefill is a simulator baseline: "
                             "a live decode worker's blocks are reserved at placement; use "
                             "early (prediction-based), slo or none")
        if config.decode_kv_capacity_tokens is None:  # the decode side of early rejection
            decoders = [h for h in workers if h.role in ("decode", "colocated")]
            if decoders:
                config = replace(config, decode_kv_capacity_tokens=min(
                    h.num_blocks * h.block_size for h in decoders))
        conductor = Conductor(config, prefill_ids, decode_ids, prefill_model, decode_model,
                              layout.kv_bytes_per_token)
        for hello in workers:  # CPP stages: placed only as their group (conductor/cpp.py)
            if hello.role == "cpp":
                conductor.add_prefill_instance(hello.worker_id, cpp_member=hello.cpp_member)
        return cls(conductor, layout.block_size, store_audit, layout.num_layers)

    # -- admission -----------------------------------------------------------------------------
    def place(self, request: ScheduleRequest, now_s: float) -> Placement:
        """The Conductor's placement; `Rejected` (with its predictions and retry-after) when
        it will not take the request now."""
        decision = self.conductor.schedule(request, now_s)
        if not isinstance(decision, Placement):
            raise Rejected(f"the Conductor rejected the request ({decision.reason.value}: "
                           f"predicted TTFT {decision.predicted_ttft_s:.3f} s, TBT "
                           f"{decision.predicted_tbt_s:.3f} s)", decision.retry_after_s,
                           decision.reason.value)
        return decision

    # -- a request's life ----------------------------------------------------------------------
    def prefill_started(self, placement: Placement, request_id: str, now_s: float) -> None:
        self.conductor.on_prefill_started(placement.prefill_id, request_id, now_s)

    def prefill_done(self, placement: Placement, done: PrefillDone, now_s: float) -> None:
        """The prefill (and its KV hand-off) ended. Its prefix fetch, as the worker measured
        it, updates the Conductor's bandwidth estimate. A short fetch means some planned blocks
        may have left the store: the audit checks them first."""
        self.conductor.on_prefill_finished(placement.prefill_id, done.request_id, now_s)
        self.conductor.on_transfer_done(done.request_id, now_s)
        if done.fetch_bytes > 0:
            self.conductor.on_transfer_measured(done.fetch_bytes, done.fetch_s)
        fetch = placement.fetch
        if fetch is not None and self.store_audit is not None and \
                done.num_fetched_tokens < len(fetch.keys) * self.block_size:
            self.store_audit.suspect([cast(int, k) for k in fetch.keys])

    def decode_joined(self, placement: Placement, request_id: str, now_s: float) -> None:
        self.conductor.on_decode_joined(placement.decode_id, request_id, now_s)

    def request_ended(self, request_id: str) -> None:
        """Finished, failed or aborted: the Conductor forgets whatever is still booked."""
        self.conductor.on_request_aborted(request_id)

    # -- the live index ------------------------------------------------------------------------
    def on_kv_events(self, worker_id: str, events: KvEvents) -> None:
        """A prefill worker's cache changed (decode workers' caches are not placement targets)."""
        if worker_id in self.conductor.prefill_ids:
            self.conductor.on_blocks_stored(worker_id, events.stored)
            self.conductor.on_blocks_removed(worker_id, events.removed)

    def on_store_events(self, events: StoreEvents) -> None:
        """Blocks the store holds now: whole, or (a CPP stage's) a slice of their layers, listed
        only once every slice of a block is in (`StageStores`): never a block in part."""
        stored = events.stored
        slices: tuple[range, ...] = ()
        if events.layers:
            if self.stage_stores is None:
                return
            stored = self.stage_stores.add(events.stored, events.layers)
            slices = self.stage_stores.split
        if not stored:
            return
        self.conductor.on_blocks_stored(STORE_HOLDER, stored)
        if self.store_audit is not None:  # keys the audit dropped to stay bounded
            self.conductor.on_blocks_removed(STORE_HOLDER,
                                             self.store_audit.track(stored, slices))

    def store_layer_bounds(self) -> list[int]:
        """The layer slices CPP stages store blocks in, as bounds [0, .., num_layers] ([]: none
        reported, or not one split of all the layers)."""
        stores = self.stage_stores
        if stores is None or not stores.split:
            return []
        bounds = [0, *(r.stop for r in stores.split)]
        if bounds[-1] != stores.num_layers or any(
                r.start != b for r, b in zip(stores.split, bounds, strict=False)):
            return []
        return bounds

    def on_store_gone(self, keys: list[int]) -> None:
        """The store audit found these blocks gone from the store."""
        self.conductor.on_blocks_removed(STORE_HOLDER, keys)

    # -- membership ----------------------------------------------------------------------------
    def set_draining(self, worker_id: str, role: str, draining: bool,
                     cpp_member: int | None = None) -> None:
        """Stop (or resume) placing requests on a live worker of `role`; a resumed prefill
        worker starts with an empty view of its cache; a CPP stage (`cpp_member`) rejoins its
        group."""
        conductor = self.conductor
        known = worker_id in conductor.prefill_ids or worker_id in conductor.decode_ids
        if draining and known:
            conductor.remove_instance(worker_id)
        elif not draining and not known:
            if role == "decode":
                conductor.add_decode_instance(worker_id)
            elif role == "cpp":
                conductor.add_prefill_instance(worker_id, cpp_member=cpp_member)
            else:
                conductor.add_prefill_instance(worker_id)
                if conductor.config.policy is Policy.COLOCATED:
                    conductor.add_decode_instance(worker_id)

    def remove(self, worker_id: str) -> None:
        """A lost worker: no request is placed on it any more."""
        self.conductor.remove_instance(worker_id)
