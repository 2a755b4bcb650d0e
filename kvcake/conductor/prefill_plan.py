"""One prefill candidate's plan as Algorithm 1 makes it (`Plan`), the predicted prefill times it
is made of (`PrefillTimes`), and the `fetch_only_if_faster` correction of plans whose fetch is
slower than recomputing (`turn_down_slow_fetches`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from kvcake.conductor.cpp import pipelined_prefill_s
from kvcake.conductor.predictor import PrefillModel

Plan = tuple[int, int, float, float, float | None]
"""(local_len, prefix_len, transfer_s, prefill_s, recompute_s): one instance's prefill plan, the
fields of `PrefillEstimate` without its queue; recompute_s is the local alternative when
fetch_only_if_faster must weigh it (else None)."""


def at_speed(plan: Plan, speed: float) -> Plan:
    """The plan on an instance whose prefills take `speed` times the fit (its learned speed:
    `PrefillQueue.speed`): its prefill and recompute seconds scaled, its fetch not."""
    if speed == 1.0:
        return plan
    local_len, prefix_len, transfer_s, prefill_s, recompute_s = plan
    return (local_len, prefix_len, transfer_s, prefill_s * speed,
            None if recompute_s is None else recompute_s * speed)


_MAX_PREDICTIONS = 1 << 16  # remembered prefill predictions (a few MB at most)


class PrefillTimes:
    """Predicted prefill seconds of a prompt given its reused prefix; with `pipelined`, over a
    CPP group of `cpp_nodes` in chunks of `cpp_chunk_tokens` (`pipelined_prefill_s`)."""

    def __init__(self, model: PrefillModel, cpp_nodes: int, cpp_chunk_tokens: int) -> None:
        self._model = model
        self._cpp_nodes = cpp_nodes
        self._cpp_chunk_tokens = cpp_chunk_tokens
        self._predicted: dict[tuple[int, int], float] = {}  # (prompt, prefix) -> s

    def seconds(self, prompt_len: int, prefix_len: int, pipelined: bool = False) -> float:
        # The model is a pure function of its arguments, and prompt lengths repeat: keep its
        # answers (a bounded table, cleared when full) rather than ask again.
        key = (prompt_len, prefix_len)
        seconds = self._predicted.get(key)
        if seconds is None:
            if len(self._predicted) >= _MAX_PREDICTIONS:
                self._predicted.clear()
            seconds = self._predicted[key] = self._model.predict(*key)
        if pipelined:
            seconds = pipelined_prefill_s(seconds, prompt_len - prefix_len, self._cpp_nodes,
                                          self._cpp_chunk_tokens)
        return seconds


def turn_down_slow_fetches(plans: list[Plan], queues: list[float], ttfts: list[float]) -> None:
    """fetch_only_if_faster: where recomputing locally finishes no later than fetching, plan that
    (`plans` and their `ttfts` are changed in place)."""
    local_plans: dict[int, Plan] = {}  # local_len -> the recompute plan
    for i, (plan, queue_s) in enumerate(zip(plans, queues, strict=True)):
        recompute_s = plan[4]
        if recompute_s is not None and queue_s + recompute_s <= ttfts[i]:
            local_len = plan[0]
            local = local_plans.get(local_len)
            if local is None:
                local = local_plans[local_len] = (local_len, local_len, 0.0, recompute_s, None)
            plans[i] = local
            ttfts[i] = 0.0 + queue_s + recompute_s
