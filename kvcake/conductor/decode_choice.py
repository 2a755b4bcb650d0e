"""Where a request decodes: every decode instance's predicted TBT with the request added, and the
choice among them (least predicted TBT; ties to the instance with the fewest requests booked).

A batch whose KV would not fit `decode_kv_capacity_tokens` is predicted at TBT +inf: its requests
would wait for memory, a gap no step time shows.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import itemgetter

from kvcake.conductor.config import Admission, ConductorConfig, Policy
from kvcake.conductor.decision import DecodeEstimate, ScheduleRequest
from kvcake.conductor.load import DecodeLoad
from kvcake.conductor.predictor import DecodeModel

_TBT_S = itemgetter(3)  # DecodeEstimate.tbt_s


class DecodeChoice:
    """Decode estimates and the choice among them, over the live `decodes` books."""

    def __init__(self, config: ConductorConfig, decodes: dict[str, DecodeLoad],
                 decode_model: DecodeModel) -> None:
        self.config = config
        self._decodes = decodes
        self._decode_model = decode_model
        self._last_estimates: dict[str, DecodeEstimate] = {}  # instance -> its last one
        admission = config.admission
        self._forecasts_join = admission is Admission.EARLY or (
            admission is Admission.DECODE_AFTER_PREFILL and config.decode_check_keeps_node)
        self._counts_outstanding = admission is Admission.SLO

    def forget(self, instance_id: str) -> None:
        self._last_estimates.pop(instance_id, None)

    def estimate(self, req: ScheduleRequest, prefill_id: str, now_s: float,
                 ttft_s: float) -> tuple[DecodeEstimate, ...]:
        """Every candidate decode instance (colocated: the prefill instance itself) with `req`
        added, at the moment it joins (after its predicted TTFT: Admission.EARLY, and the
        baseline's pre-selection when it keeps its node, `forecasts_join`), its outstanding load
        now (Admission.SLO, `outstanding_at`) or its load now."""
        forecast = self._forecasts_join
        at_s = now_s + ttft_s if forecast else now_s
        context = req.prompt_len + req.max_output_len // 2
        loads = self._decodes
        if self.config.policy is Policy.COLOCATED:
            loads = {prefill_id: self._decodes[prefill_id]}
        step = self._decode_model.decode_step_time_s
        fits = self.kv_fits
        # An estimate is a pure function of (instance, batch, context tokens), and an instance's
        # forecast rarely changes between decisions: reuse the last estimate when it matches
        # rather than asking the model again and allocating a new record.
        last_estimates = self._last_estimates
        new = tuple.__new__  # what DecodeEstimate(...) does, without its Python-level __new__
        estimates = []
        now = not forecast
        forecasts: Iterable[tuple[int, int]]
        if not now and self.config.uniform_decode_s is not None:
            forecasts = (load.batch_window(now_s, at_s) for load in loads.values())
        elif self._counts_outstanding:
            forecasts = map(self.outstanding_at, loads.values(), repeat(now_s))
        else:
            forecasts = map(self.load_at(now), loads.values(), repeat(at_s))
        for instance_id, (batch, tokens) in zip(loads, forecasts, strict=True):
            batch, tokens = batch + 1, tokens + context
            if not fits(req.max_output_len, batch, tokens, loads[instance_id]):
                estimates.append(new(DecodeEstimate, (instance_id, batch, tokens, math.inf)))
                continue
            estimate = last_estimates.get(instance_id)
            if estimate is None or estimate[1] != batch or estimate[2] != tokens:
                estimate = new(DecodeEstimate, (instance_id, batch, tokens, step(batch, tokens)))
                last_estimates[instance_id] = estimate
            estimates.append(estimate)
        return tuple(estimates)

    def outstanding_at(self, load: DecodeLoad, now_s: float) -> tuple[int, int]:
        """(batch size, context tokens) an instance has outstanding at `now_s`: its load of the
        moment (`load_at(True)`) plus every request dispatched to it and not joined yet
        (`DecodeLoad.expected_after`: in prefill, or waiting for its memory). What early
        rejection (Admission.SLO) reads at arrival, for the check and the choice: the load of
        the moment alone leaves out what was placed a prefill ago, so every arrival of a
        prefill-queue time would go to the same least-loaded instance (herding) and be let in
        on room already promised; a least-outstanding balancer, and a decode node that reserves
        a request's KV when it is dispatched (the live `ReserveKv`), count it."""
        batch, tokens = self.load_at(True)(load, now_s)
        later, later_tokens = load.expected_after(now_s)
        return batch + later, tokens + later_tokens

    @property
    def forecasts_join(self) -> bool:
        """Whether the arrival estimate reads each instance's forecast at the request's predicted
        join time (counting the requests in prefill booked to have joined by then) rather than
        its load now: Admission.EARLY, whose check it is, and Admission.DECODE_AFTER_PREFILL with
        `decode_check_keeps_node`, whose arrival choice is final for the node (the KV streams
        there during the prefill; only that node is checked after it). Read now, every arrival
        of a prefill-queue time would be pre-selected to the same least-loaded node, which is
        full when they reach it (herding); the fair baseline pre-selects as early rejection
        does and only checks later."""
        return self._forecasts_join

    def estimate_now(self, context: int, output_len: int,
                     now_s: float) -> tuple[DecodeEstimate, ...]:
        """Every decode instance with a request of `context` tokens joining now (a prefill that
        has finished: `admit_decode`)."""
        estimates = []
        load_now = self.load_at(True)
        for instance_id, load in self._decodes.items():
            batch, tokens = load_now(load, now_s)
            batch, tokens = batch + 1, tokens + context
            tbt_s = (self._decode_model.decode_step_time_s(batch, tokens)
                     if self.kv_fits(output_len, batch, tokens, load) else math.inf)
            estimates.append(DecodeEstimate(instance_id, batch, tokens, tbt_s))
        return tuple(estimates)

    def load_at(self, now: bool) -> Callable[[DecodeLoad, float], tuple[int, int]]:
        """How a decode instance's batch is read: at a later moment, the forecast (requests
        predicted to have finished by then left out); now, under a uniform decode time t_d, the
        reported batch (a request that outlives t_d still decodes: the paper's t_d forecasts
        the future, the load of the moment is known). (A later moment under t_d is read by
        `DecodeLoad.batch_window` in `estimate`: the requests whose decode window [join,
        join + t_d) holds it.)"""
        if now and self.config.uniform_decode_s is not None:
            return DecodeLoad.batch_now
        return DecodeLoad.batch_at

    def kv_fits(self, max_output_len: int, batch_size: int, context_tokens: int,
                load: DecodeLoad | None = None) -> bool:
        """Whether a batch of `batch_size` requests of `max_output_len` output tokens, holding
        `context_tokens` on average (prompt + max_output_len // 2 each), fits
        `decode_kv_capacity_tokens` when each reserves its prompt plus its whole output. Where
        the instance reported its KV (`on_decode_kv`), what it holds beyond the book is counted
        too."""
        capacity = self.config.decode_kv_capacity_tokens
        if capacity is None:
            return True
        rest_of_output = max_output_len - max_output_len // 2
        extra = 0 if load is None else load.kv_undercount(rest_of_output)
        return context_tokens + batch_size * rest_of_output + extra <= capacity

    def choose(self, candidates: tuple[DecodeEstimate, ...]) -> DecodeEstimate:
        """Least predicted TBT; among equals (e.g. all idle at the forecast time) the instance
        with the fewest requests booked, so a burst does not pile onto the first instance."""
        tbts = list(map(_TBT_S, candidates))
        best_tbt = min(tbts)
        if tbts.count(best_tbt) == 1 and best_tbt == best_tbt:  # (NaN: no ties, as ==)
            return candidates[tbts.index(best_tbt)]
        decodes = self._decodes
        chosen: DecodeEstimate | None = None
        fewest = 0
        for candidate in candidates:  # the first of the least booked, as min() would pick
            if candidate[3] == best_tbt:
                num_booked = decodes[candidate[0]].num_booked
                if chosen is None or num_booked < fewest:
                    chosen, fewest = candidate, num_booked
        if chosen is None:
            raise ValueError(f"no decode candidate has the least predicted TBT {best_tbt!r}")
        return chosen
