"""A live profile's shared host: its prefill and decode workers slow each other down.

A live profile measured on one host (`kvcake simulate --live-profile`, live_profile.py) makes a
decode step dearer while a prefill computes there (`StepCosts.decode_step_busy_s`: the decode
instance's runs follow the host, cut at their next step boundary when the prefill worker starts
or stops, `DecodeInstance.follow_host`), and a prefill that starts while a decode batch runs
slower by the measured `prefill_busy_ratio`. The simulated cluster is then that one host.

Colocated, the live profile's `colocated` terms couple the workers to one another instead: each
instance's steps (decode, mixed, chunk only) are priced by whether another instance of the host
steps, and its runs follow them as a decode instance follows the prefill worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvcake.conductor import CostModel
from kvcake.sim.decode import DecodeInstance
from kvcake.sim.prefill import PrefillInstance


class SharedHost:
    """Couples the instances to one another's activity on the shared host; `coupled`: the decode
    instances whose runs follow its prefill worker (the event loop asks them after each event)."""

    def __init__(self, prefills: Sequence[PrefillInstance], decodes: Sequence[DecodeInstance],
                 cost: CostModel, colocated: bool) -> None:
        self._prefills, self._decodes = prefills, decodes
        self.coupled = [d for d in decodes if d.costs.decode_step_busy_s is not None]
        for d in self.coupled:
            d.host_prefill_busy = (partial(self.other_stepping, d) if colocated
                                   else self.prefilling)
        ratio = getattr(cost, "prefill_busy_ratio", None)
        if ratio is not None and not colocated:
            for p in prefills:
                p.slowdown_at_start = lambda: ratio if self.decoding() else 1.0

    def prefilling(self) -> bool:
        """Whether a prefill computes on the host now."""
        return any(p.running is not None for p in self._prefills)

    def decoding(self) -> bool:
        """Whether a decode instance of the host has a batch now."""
        return any(d.running for d in self._decodes)

    def other_stepping(self, instance: DecodeInstance) -> bool:
        """Colocated: whether another instance of the host runs a step now."""
        return any(d.run is not None for d in self._decodes if d is not instance)
