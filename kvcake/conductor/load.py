"""Per-instance load books: the prefill queue and the decode batch, as the Conductor predicts them.

`PrefillQueue`: predicted prefill seconds of the requests placed on an instance, waiting or
running; its queue time is what a new request would wait (seed section IX: "aggregating the
prefill times of all queued requests").
`DecodeLoad`: the requests decoding on an instance, each with a predicted finish time, and the
requests placed there whose prefill has not finished yet, each with a predicted join time; it
answers "what batch will this instance run at time t".

Both are updated only through the caller's reports (with `now_s` as an argument); reports about
unknown requests are ignored, so a duplicate or late report is harmless.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import NamedTuple


class PrefillQueue:
    """Predicted prefill work placed on one instance.

    `speed`: how long this instance's prefills take over their fitted prediction, learned from
    the ones that finished (`finish` with a weight > 0): the exponentially weighted mean of
    their measured durations over that of their fitted ones, so a long prefill counts for more
    than a short one whose measured time is mostly fixed costs (messages, the KV hand-off); 1
    (the fit as measured) until one finished. The queue's time is its fitted predictions times
    `speed`.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, float] = {}  # request -> fitted prediction (s)
        self._waiting_s = 0.0
        self._running: dict[str, tuple[float, float]] = {}  # request -> (start_s, predicted_s)
        self.speed = 1.0
        self._measured_s = 0.0  # weighted mean of finished prefills' measured durations
        self._fitted_s = 0.0  # ... and of their fitted predictions

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._running

    def add(self, request_id: str, predicted_s: float) -> None:
        self._waiting[request_id] = predicted_s
        self._waiting_s += predicted_s

    def start(self, request_id: str, now_s: float) -> None:
        predicted = self._pop_waiting(request_id)
        if predicted is not None:
            self._running[request_id] = (now_s, predicted)

    def remove(self, request_id: str) -> None:
        """The prefill finished or the request was aborted."""
        self._pop_waiting(request_id)
        self._running.pop(request_id, None)

    def finish(self, request_id: str, now_s: float, weight: float) -> None:
        """The prefill finished: with `weight` > 0 its measured duration and its fitted
        prediction enter their weighted means with that weight, and `speed` is their ratio (a
        request that never started, or one predicted at 0 s, teaches nothing)."""
        running = self._running.get(request_id)
        if running is not None and weight > 0.0 and running[1] > 0.0:
            start_s, predicted_s = running
            first = self._fitted_s == 0.0  # the first one sets both means
            self._measured_s += (1.0 if first else weight) * (now_s - start_s - self._measured_s)
            self._fitted_s += (1.0 if first else weight) * (predicted_s - self._fitted_s)
            self.speed = self._measured_s / self._fitted_s
        self.remove(request_id)

    def queue_s(self, now_s: float) -> float:
        """Seconds until this instance has worked off everything placed on it, as predicted.

        A running prefill counts for its predicted time not yet elapsed (0 once overdue).
        """
        speed = self.speed
        left = self._waiting_s * speed
        if not self._running:
            return left
        for start_s, predicted_s in self._running.values():
            left += max(0.0, predicted_s * speed - (now_s - start_s))
        return left

    def _pop_waiting(self, request_id: str) -> float | None:
        predicted = self._waiting.pop(request_id, None)
        if predicted is not None:
            # Reset when empty so float drift cannot accumulate over a long run.
            self._waiting_s = self._waiting_s - predicted if self._waiting else 0.0
        return predicted


class _Pending(NamedTuple):  # a tuple: one small object per placed request, not two
    join_s: float
    context_tokens: int
    output_len: int


class _TimedBag:
    """Requests sorted by a predicted time, each with a context size; prefix sums by bisect.

    Parallel lists (times as plain floats, so bisect compares floats, not tuples).
    """

    def __init__(self) -> None:
        self._times: list[float] = []
        self._ids: list[str] = []
        self._contexts: list[int] = []
        self.context_sum = 0

    def __len__(self) -> int:
        return len(self._times)

    def insert(self, time_s: float, request_id: str, context_tokens: int) -> None:
        idx = bisect_right(self._times, time_s)
        self._times.insert(idx, time_s)
        self._ids.insert(idx, request_id)
        self._contexts.insert(idx, context_tokens)
        self.context_sum += context_tokens

    def delete(self, time_s: float, request_id: str) -> None:
        idx = bisect_left(self._times, time_s)
        while idx < len(self._times) and self._times[idx] == time_s:
            if self._ids[idx] == request_id:
                del self._times[idx], self._ids[idx]
                self.context_sum -= self._contexts.pop(idx)
                return
            idx += 1

    def until(self, time_s: float) -> tuple[int, int]:
        """(count, context sum) of the requests whose time is <= time_s."""
        times = self._times
        idx = bisect_right(times, time_s)
        if idx == 0:
            return 0, 0
        if idx == len(times):
            return idx, self.context_sum
        return idx, sum(self._contexts[:idx])

    def drop_until(self, time_s: float) -> None:
        """Forget the requests whose time is <= time_s."""
        idx = bisect_right(self._times, time_s)
        if idx:
            del self._times[:idx], self._ids[:idx]
            self.context_sum -= sum(self._contexts[:idx])
            del self._contexts[:idx]

    def first_after(self, time_s: float) -> float | None:
        idx = bisect_right(self._times, time_s)
        return self._times[idx] if idx < len(self._times) else None


class DecodeLoad:
    """Decoding and expected requests of one decode instance.

    A request's context is counted as prompt_len + max_output_len // 2: the KV it holds on
    average over its decode, which is what the steps it shares a batch with read.
    """

    def __init__(self) -> None:
        self._active = _TimedBag()  # keyed by predicted finish time
        self._finish_s: dict[str, float] = {}
        self._pending = _TimedBag()  # keyed by predicted join time
        self._pending_info: dict[str, _Pending] = {}
        # Under a uniform decode time t_d: every request that joined, keyed by join + t_d, kept
        # to then whether reported finished or not (`batch_window`).
        self._windows = _TimedBag()
        # The last forecast and the times [lo, hi) over which it holds: the forecast only
        # changes at a finish or join time, so consecutive decisions (whose forecast times
        # differ by a little) mostly reuse it. Any change to the book clears it.
        self._forecast: tuple[float, float, tuple[int, int]] | None = None
        self.reported_kv_tokens: int | None = None  # the node's own KV reservation, if reported

    def kv_undercount(self, rest_of_output: int) -> int:
        """KV tokens the node reports holding beyond what this book counts for its decoding
        requests (each: context + `rest_of_output`), 0 without a report. The book counts every
        request at the told output length, but a running batch holds the long outputs longest,
        so it holds more than the told length per request on average."""
        if self.reported_kv_tokens is None:
            return 0
        booked = self._active.context_sum + len(self._active) * rest_of_output
        return max(0, self.reported_kv_tokens - booked)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_booked(self) -> int:
        """Requests decoding here or placed here and still to join."""
        return len(self._active._times) + len(self._pending._times)  # decision path: no calls

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._finish_s or request_id in self._pending_info

    def expect(self, request_id: str, join_s: float, context_tokens: int, output_len: int) -> None:
        """A request was placed here; it should join at `join_s` (when its prefill finishes)."""
        self._pending_info[request_id] = _Pending(join_s, context_tokens, output_len)
        self._pending.insert(join_s, request_id, context_tokens)
        self._forecast = None

    def expected(self, request_id: str) -> tuple[int, int] | None:
        """(context tokens, output length) of a request placed here and not joined yet."""
        info = self._pending_info.get(request_id)
        return None if info is None else (info.context_tokens, info.output_len)

    def join(self, request_id: str, now_s: float,
             step_time_s: Callable[[int, int], float], decode_s: float | None = None) -> None:
        """The request joined the batch now. It should finish after `decode_s` seconds (a uniform
        forecast) or, without it, after output_len steps, each lasting
        `step_time_s(batch_size, context_tokens)` of the batch it joins (itself included)."""
        info = self._pending_info.pop(request_id, None)
        if info is None:
            return
        self._pending.delete(info.join_s, request_id)
        self._forecast = None
        if decode_s is None:
            batch, tokens = self.batch_at(now_s)
            decode_s = info.output_len * step_time_s(batch + 1, tokens + info.context_tokens)
        else:
            self._windows.drop_until(now_s)
            self._windows.insert(now_s + decode_s, request_id, info.context_tokens)
        finish_s = now_s + decode_s
        self._finish_s[request_id] = finish_s
        self._active.insert(finish_s, request_id, info.context_tokens)
        self._forecast = None

    def remove(self, request_id: str) -> None:
        """The request finished decoding, or was aborted before or after joining."""
        finish_s = self._finish_s.pop(request_id, None)
        if finish_s is not None:
            self._active.delete(finish_s, request_id)
            self._forecast = None
        info = self._pending_info.pop(request_id, None)
        if info is not None:
            self._pending.delete(info.join_s, request_id)
            self._forecast = None

    def batch_at(self, time_s: float) -> tuple[int, int]:
        """(batch size, context tokens) predicted at `time_s`: the decoding requests not
        predicted to have finished by then, plus the expected ones predicted to have joined."""
        # On the decision path for every decode instance: touch the lists directly.
        forecast = self._forecast
        if forecast is not None and forecast[0] <= time_s < forecast[1]:
            return forecast[2]
        active, pending = self._active, self._pending
        done, done_ctx = active.until(time_s) if active._times else (0, 0)
        joined, joined_ctx = pending.until(time_s) if pending._times else (0, 0)
        batch = len(active._times) - done + joined
        tokens = active.context_sum - done_ctx + joined_ctx
        # The same counts hold from the latest time counted (until() counts times <= time_s)
        # up to, not including, the next time of either bag.
        lo, hi = _bounds(active._times, done)
        pending_lo, pending_hi = _bounds(pending._times, joined)
        counts = (batch, tokens)
        self._forecast = (max(lo, pending_lo), min(hi, pending_hi), counts)
        return counts

    def batch_now(self, now_s: float) -> tuple[int, int]:
        """(batch size, context tokens) now, as reported: every request that joined and has not
        been reported finished (whatever its predicted finish), plus the expected ones predicted
        to have joined by now. With a uniform decode time the finish times are a forecast for
        later moments; which requests still decode now the caller's reports say."""
        pending = self._pending
        joined, joined_ctx = pending.until(now_s) if pending._times else (0, 0)
        return len(self._active._times) + joined, self._active.context_sum + joined_ctx

    def expected_after(self, now_s: float) -> tuple[int, int]:
        """(count, context tokens) of the requests placed here that are not predicted to have
        joined by `now_s`: dispatched to this instance and still in prefill (or waiting for
        memory at it), whose KV it will have to hold. `batch_now` / `batch_at(now_s)` plus this
        is the instance's outstanding load (what a least-outstanding balancer counts)."""
        pending = self._pending
        if not pending._times:
            return 0, 0
        joined, joined_ctx = pending.until(now_s)
        return len(pending._times) - joined, pending.context_sum - joined_ctx

    def batch_window(self, now_s: float, at_s: float) -> tuple[int, int]:
        """(batch size, context tokens) at `at_s` >= `now_s` under the uniform decode time t_d
        of `join(..., decode_s=t_d)`, as the paper's system-level forecast has it: the requests
        whose decode window [join, join + t_d) holds at_s (those that joined, by their actual
        join, whether reported finished or not) plus the expected ones predicted to join by
        at_s. A request that finished early still counts to join + t_d, one that outlives t_d
        no longer does: with t_d the mean decode time the two balance (Little's law). Counting
        one side only biases the forecast: leaving out the requests past t_d but keeping the
        reports of early finishes (`batch_at`) sees ~31% of a running batch too few when decode
        times spread; keeping the reported batch whole (`batch_now`) for a later moment counts
        those that finish in between."""
        if at_s < now_s:
            raise ValueError(f"at_s ({at_s}) must not be before now_s ({now_s})")
        windows, pending = self._windows, self._pending
        windows.drop_until(now_s)
        ended, ended_ctx = windows.until(at_s) if windows._times else (0, 0)
        joined, joined_ctx = pending.until(at_s) if pending._times else (0, 0)
        return (len(windows._times) - ended + joined,
                windows.context_sum - ended_ctx + joined_ctx)

    def next_finish_after(self, time_s: float) -> float | None:
        return self._active.first_after(time_s)


def _bounds(times: list[float], num_counted: int) -> tuple[float, float]:
    """[the last counted time, the first uncounted one) of a sorted list; -inf / inf at the ends."""
    lo = times[num_counted - 1] if num_counted else -math.inf
    hi = times[num_counted] if num_counted < len(times) else math.inf
    return lo, hi
