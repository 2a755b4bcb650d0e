"""The books a placement opens and the caller's reports close: the request's prefill on its
instance's queue (a CPP request: on every member of its group), its expected join on its decode
instance, its planned fetch, and its prompt's blocks pending on the prefill instance.

Reports about unknown requests or instances are ignored (a late or duplicate report is
harmless), except where the instance must be known (`InstancePools.queue`/`decode` say so).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from kvcake.conductor.decision import FetchPlan, PrefillEstimate, ScheduleRequest
from kvcake.conductor.pending import PendingBlocks
from kvcake.conductor.pools import InstancePools
from kvcake.conductor.transfers import Transfers


class Placements:
    """Where each placed request is booked. `index_on_placement`: its prompt's blocks become
    the prefill instance's local prefix (`pending`) at once, for the requests placed after it."""

    def __init__(self, pools: InstancePools, pending: PendingBlocks, transfers: Transfers,
                 index_on_placement: bool, speed_weight: float = 0.0) -> None:
        self._pools = pools
        self._pending = pending
        self._transfers = transfers
        self._index_on_placement = index_on_placement
        # how much a finished prefill's measured duration moves its instances' learned speed
        # (`PrefillQueue.finish`; 0: not at all)
        self._speed_weight = speed_weight
        self.placed: dict[str, tuple[str, str]] = {}  # request -> (prefill_id, decode_id)
        self._group_of: dict[str, tuple[str, ...]] = {}  # CPP request -> its group

    def book(self, req: ScheduleRequest, now_s: float, chosen: PrefillEstimate, decode_id: str,
             fetch: FetchPlan | None, group: tuple[str, ...] = ()) -> None:
        rid = req.request_id
        members = group or (chosen.instance_id,)
        if group:  # the pipeline holds every member for its whole duration
            self._group_of[rid] = group
        queues = self._pools.queues
        # the queue keeps the fitted prediction (a single instance's estimate was scaled by its
        # learned speed: `Conductor._estimate_prefills`; a CPP group's is not)
        fitted_s = chosen.prefill_s if group else chosen.prefill_s / queues[chosen.instance_id].speed
        for member in members:
            queues[member].add(rid, fitted_s)
        context = req.prompt_len + req.max_output_len // 2
        self._pools.decodes[decode_id].expect(rid, now_s + chosen.ttft_s, context,
                                              req.max_output_len)
        self.placed[rid] = (chosen.instance_id, decode_id)
        if fetch is not None:
            self._transfers.book(rid, fetch)
        if self._index_on_placement:  # local to the instance from now, fetchable once stored
            self._pending.add(rid, members, req.block_keys)

    def prefill_started(self, instance_id: str, request_id: str, now_s: float) -> None:
        for member in self._group_of.get(request_id, (instance_id,)):
            self._pools.queue(member).start(request_id, now_s)

    def prefill_finished(self, instance_id: str, request_id: str, now_s: float) -> None:
        group = self._group_of.pop(request_id, None)
        if group is None:
            self._pools.queue(instance_id).finish(request_id, now_s, self._speed_weight)
        queues = self._pools.queues
        for member in group or ():
            if member in queues:
                queues[member].finish(request_id, now_s, self._speed_weight)
        self._pending.release(request_id)

    def take_decode(self, request_id: str) -> tuple[int, int] | None:
        """Lift the request's booking off its decode instance, to book it again: its
        (context_tokens, output_len); None (nothing changed) when it has no such booking."""
        placed = self.placed.get(request_id)
        if placed is None:
            return None
        booked_on = self._pools.decode(placed[1])
        expected = booked_on.expected(request_id)
        if expected is not None:
            booked_on.remove(request_id)
        return expected

    def rebook_decode(self, request_id: str, instance_id: str, now_s: float,
                      expected: tuple[int, int]) -> None:
        """The request lifted by `take_decode` joins `instance_id` now."""
        prefill_id = self.placed[request_id][0]
        self._pools.decode(instance_id).expect(request_id, now_s, *expected)
        self.placed[request_id] = (prefill_id, instance_id)

    def move_decode(self, request_id: str, instance_id: str, now_s: float) -> None:
        """The request's decode booking moves to `instance_id`, expected to join now."""
        placed = self.placed.get(request_id)
        if placed is None or placed[1] == instance_id:
            return
        expected = self.take_decode(request_id)
        if expected is not None:
            self.rebook_decode(request_id, instance_id, now_s, expected)

    def decode_finished(self, instance_id: str, request_id: str) -> None:
        self._pools.decode(instance_id).remove(request_id)
        self.placed.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Forget every booking of `request_id`."""
        self._transfers.done(request_id)
        self._pending.release(request_id)
        placed = self.placed.pop(request_id, None)
        if placed is None:
            return
        prefill_id, decode_id = placed
        queues, decodes = self._pools.queues, self._pools.decodes
        for member in self._group_of.pop(request_id, (prefill_id,)):
            if member in queues:
                queues[member].remove(request_id)
        if decode_id in decodes:
            decodes[decode_id].remove(request_id)
